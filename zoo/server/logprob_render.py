"""``TokenLogprob`` records in the shapes of the OpenAI APIs.

    chat / responses   [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]
    completions        {"tokens": [str], "token_logprobs": [float | None],
                        "top_logprobs": [{str: float} | None], "text_offset": [int]}

A token's string is its text when its bytes are whole UTF-8, else ``"bytes:\\xNN..."`` (as OpenAI
writes a piece of a character); ``bytes`` are its UTF-8 bytes as integers. ``text_offset`` is each
token's character offset in the concatenation of the token strings, from ``offset``.
"""

from __future__ import annotations

from zoo.engine.logprobs import TokenLogprob


class LogprobRenderer:
    """Renders records with ``tokenizer``'s token bytes (cached per id)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """(token string, its bytes as integers); an id past the tokenizer's vocabulary (a checkpoint
        pads its embedding rows beyond it) is the empty string with no bytes."""
        if token_id not in self._cache:
            try:
                raw = self._tok.token_bytes(token_id)
            except ValueError:              # a padding row of the embedding: no text
                raw = b""
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def chat(self, recs: list[TokenLogprob]) -> list[dict]:
        """Chat completions' ``logprobs.content`` (also the Responses API's ``logprobs``)."""
        return [{**self._entry(r.token, r.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in r.top]}
                for r in recs]

    def completion(self, recs: list[TokenLogprob], offset: int = 0) -> dict:
        """Legacy completions' ``logprobs`` object; a record without a logprob (the first prompt
        token) has None for its logprob and its alternatives."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for r in recs:
            text = self.piece(r.token)[0]
            top: dict | None = None
            if r.logprob is not None:
                top = {}
                for t, lp in r.top:
                    top.setdefault(self.piece(t)[0], lp)
            out["tokens"].append(text)
            out["token_logprobs"].append(r.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out
