"""Tokenizer: HF ``tokenizers`` plus the checkpoint's jinja2 chat template.

``Tokenizer.from_dir(path)`` reads ``tokenizer.json`` and ``tokenizer_config.json`` (the chat
template may also sit in ``chat_template.jinja``); it returns None when the directory has no
tokenizer. The template is rendered in a sandboxed jinja2 environment with the helpers HF
templates use (``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import bisect
import datetime
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tok: HFTokenizer) -> bool:
    """The tokenizer decodes with the byte-level alphabet (GPT-2, Qwen, GLM)."""
    return type(tok.decoder).__name__ == "ByteLevel"


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True)
class Encoded:
    """A text and its encoding: ``ids``, and per token the character offset where it ends (``ends``)."""
    text: str
    ids: list[int]
    ends: list[int]


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (compared in slices, in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:                       # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], chat_template: str | None):
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.eos_token_ids = tuple(i for i in [self.token_to_id(self.eos_token)] if i is not None)
        self._template = None
        self._added: set[int] | None = None
        self._boundaries: frozenset[int] | None = None
        self.chars_encoded = 0

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            return None
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(HFTokenizer.from_file(str(tok_file)), config, template)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) to ``path``
        so that ``from_dir(path)`` gives this tokenizer back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        config = {**self.config, "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token string -> its id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def special_tokens(self) -> dict[int, str]:
        """id -> text of the special added tokens (control tokens such as ``<|im_end|>``)."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, so that a text of c characters
        has at least c / this many tokens; None where no bound holds (a model with an unknown
        token that may swallow any span, a normalizer that may delete text). For BPE a token's
        span is at most its piece's length (byte-level pieces spell UTF-8 bytes, ``<0xNN>`` one
        byte); Unicode normalization may compose up to 4 characters into one."""
        spec = json.loads(self._tok.to_str())
        model, norm = spec.get("model") or {}, spec.get("normalizer")
        if model.get("type") != "BPE" or (model.get("unk_token") is not None and not model.get("byte_fallback")):
            return None
        norms = [] if norm is None else norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
        if any(n.get("type") not in ("NFC", "NFD", "NFKC", "NFKD") for n in norms):
            return None
        longest = max(len(piece) for piece in self.vocab())
        return longest * (4 if norms else 1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """``encode`` and, per token, the character offset where its text ends (``chars_encoded``
        counts the characters this has tokenized)."""
        self.chars_encoded += len(text)
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [end for _, end in enc.offsets]

    def encode_continuing(self, text: str, prior: "Encoded | None" = None) -> "Encoded":
        """``text`` encoded (``encode_with_ends``), reusing the tokens of ``prior`` (an earlier text's
        encoding) up to the last boundary token that lies wholly in the text both begin with: only
        the rest is tokenized. A boundary is a special added token that strips no whitespace: the
        tokenizer splits the text at such tokens before anything else, so what precedes one never
        changes what follows. The result equals a full ``encode_with_ends(text)``."""
        cut, keep = 0, 0
        if prior is not None and prior.ids:
            shared = common_prefix(prior.text, text)
            boundary = self._boundary_ids()
            i = bisect.bisect_right(prior.ends, shared) - 1
            while i >= 0 and prior.ids[i] not in boundary:
                i -= 1
            if i >= 0:
                cut, keep = prior.ends[i], i + 1
        ids, ends = self.encode_with_ends(text[cut:])
        return Encoded(text, prior.ids[:keep] + ids if keep else ids,
                       prior.ends[:keep] + [cut + e for e in ends] if keep else ends)

    def _boundary_ids(self) -> frozenset[int]:
        """Special added tokens that strip nothing, if the text after one tokenizes alone as it does
        after it (checked on probe texts: a tokenizer that treats a text's start apart, as a
        prepended space, has none)."""
        if self._boundaries is None:
            found = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                     if t.special and not t.lstrip and not t.rstrip}
            alone = all(self.encode("x" + token + after) == self.encode("x" + token) + self.encode(after)
                        for token in list(found.values())[:4] for after in (" y\n z", "y z", "\n\ny"))
            self._boundaries = frozenset(found if alone else ())
        return self._boundaries

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a piece of UTF-8 text, possibly not a whole
        character): byte-level BPE pieces mapped back to bytes, ``<0xNN>`` byte-fallback pieces as
        that byte, added tokens as their UTF-8 text; ValueError for an id outside the vocabulary."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})")
        if int(token_id) in self._added_ids():
            return piece.encode()
        if _is_byte_level(self._tok) and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode()

    def _added_ids(self) -> set[int]:
        if self._added is None:
            self._added = set(self._tok.get_added_tokens_decoder())
        return self._added

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's chat template (extra kwargs reach the template,
        e.g. ``enable_thinking``)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
