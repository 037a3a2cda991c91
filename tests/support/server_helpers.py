"""Test fixtures for the server: chat templates in the Qwen3.x and GLM styles, and a *scripted*
tiny model that says a chosen text, so tool calls and reasoning can be tested end to end.

``ScriptedLM`` wraps the embedded tiny model (its first ``SCRIPTED_LAYERS`` layers): a prompt
holding ``<|endoftext|>`` followed by a letter (``say(i)``) makes it generate the tokens of
``scripts[i]`` and then end its turn, by forcing its logits inside the jitted forward; any other
prompt gets the tiny model's own output. The tokens still go through the real engine (prefill,
batching, decode, callbacks), the real detokenizer and the real parsers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo
from zoo.api import Model
from zoo.models.shared.cache import ModelCache
from zoo.registry import embedded_path
from zoo.sharding.cache_axes import CacheState, cache_state

MARK = "<|endoftext|>"

QWEN_TEMPLATE = """
{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content }}
{%- for tc in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n<function=' + tc.function.name + '>\\n' }}
{%- for k, v in tc.function.arguments.items() %}
{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""

GLM_TEMPLATE = """
{%- if tools %}{{- '<|im_start|>system\\n# Tools:' }}
{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role in ('system', 'user') %}{{- '<|im_start|>' + message.role + '\\n'
                                                 + message.content + '<|im_end|>' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}
{{- message.content }}
{%- for tc in message.tool_calls or [] %}{{- '<tool_call>' + tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' }}
{%- endfor %}{{- '</tool_call>' }}{%- endfor %}{{- '<|im_end|>' }}
{%- elif message.role == 'tool' %}{{- '<|im_start|>observation\\n' + message.content + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think></think>' }}{%- endif %}
{%- endif %}"""


def say(i: int) -> str:
    """User text that makes a ``ScriptedLM`` say its script ``i``."""
    return MARK + chr(ord("A") + i)


class ScriptTable(nnx.Variable):
    """The scripts' token ids [n, max_len + 1], padded with the end-of-turn id."""


@cache_state
class ScriptCache(CacheState):
    """The wrapped model's cache (without its MTP part) and each row's script and step."""

    AXES = {"script": ("batch",), "step": ("batch",), "last": ("batch",)}
    inner: ModelCache
    script: jax.Array
    step: jax.Array
    last: jax.Array             # the row's last real token so far (-1: none), so a marker and its letter
                                # may sit in two prefill pieces

    def without_mtp(self) -> "ScriptCache":
        return self

    @property
    def slots(self):
        """The wrapped model's slot bookkeeping (what the generator reads and trims)."""
        return self.inner.slots

    def replace(self, **changes):
        if "slots" in changes:
            changes["inner"] = self.inner.replace(slots=changes.pop("slots"))
        return super().replace(**changes)


class ScriptedLM(nnx.Module):
    """The tiny model, with scripted answers (see the module doc). Plain decoding only (no MTP)."""

    def __init__(self, inner: nnx.Module, scripts: list[list[int]], *, mark: int, first_letter: int, eos: int):
        self.inner = inner
        self.config, self.dtype, self.mtp = inner.config, inner.dtype, None
        table = np.full((len(scripts), max(map(len, scripts)) + 1), eos, np.int32)
        for i, ids in enumerate(scripts):
            table[i, :len(ids)] = ids
        self.table = ScriptTable(jnp.asarray(table))
        self.mark, self.first_letter = mark, first_letter

    def init_cache(self, batch: int, length: int) -> ScriptCache:
        return ScriptCache(inner=self.inner.init_cache(batch, length).without_mtp(),
                           script=jnp.full((batch,), -1, jnp.int32), step=jnp.zeros((batch,), jnp.int32),
                           last=jnp.full((batch,), -1, jnp.int32))

    def __call__(self, ids, mask, cache: ScriptCache, keep_steps: bool = False):
        logits, hidden, inner = self.inner(ids, mask, cache.inner, keep_steps)
        table = self.table.get_value()
        mask = mask.astype(bool)
        count = mask.astype(jnp.int32).sum(axis=1)
        if ids.shape[1] > 1:                      # a prompt piece (real tokens first): look for the marker
            ext = jnp.concatenate([cache.last[:, None], ids], axis=1)        # with the previous piece's last
            real = jnp.concatenate([cache.last[:, None] >= 0, mask], axis=1)
            hits = (ext == self.mark) & real
            hits = hits & jnp.concatenate([real[:, 1:], jnp.zeros_like(real[:, :1])], axis=1)   # a letter follows
            at = ext.shape[1] - 1 - jnp.argmax(hits[:, ::-1], axis=1)
            letter = jnp.take_along_axis(ext, jnp.minimum(at + 1, ext.shape[1] - 1)[:, None], 1)[:, 0]
            chosen = letter - self.first_letter
            valid = hits.any(1) & (chosen >= 0) & (chosen < table.shape[0])
            script = jnp.where(valid, chosen, cache.script)
            step = jnp.zeros_like(cache.step)
        else:                                     # a decode step: the next token of the script
            script = cache.script
            step = cache.step + mask[:, 0].astype(jnp.int32)
        forced = table[jnp.maximum(script, 0), jnp.minimum(step, table.shape[1] - 1)]
        forced_logits = jnp.where(jax.nn.one_hot(forced, logits.shape[-1]) > 0, 0.0, -1e9).astype(logits.dtype)
        at = jnp.maximum(count - 1, 0)[:, None, None]                      # the last real token
        last_logits = jnp.where((script >= 0)[:, None], forced_logits, jnp.take_along_axis(logits, at, 1)[:, 0])
        logits = jnp.where(jnp.arange(logits.shape[1])[None, :, None] == at, last_logits[:, None], logits)
        last = jnp.where(count > 0, jnp.take_along_axis(ids, at[:, :, 0], 1)[:, 0], cache.last)
        return logits, hidden, ScriptCache(inner=inner, script=script, step=step, last=last)


def checkpoint_with_template(root: Path, template: str, context: int | None = None, layers: int | None = None) -> Path:
    """A copy of the embedded tiny checkpoint whose tokenizer carries ``template`` (and whose
    context, ``max_position_embeddings``, is ``context`` if given; with ``layers``, only its first
    ``layers`` decoder layers, their trained weights, and its MTP layer)."""
    from safetensors.flax import load_file, save_file  # (bfloat16, which numpy lacks)

    from tests.support.random_checkpoints import with_layers

    src, dst = embedded_path("qwen38-tiny"), Path(root)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if layers is None or f.name != "model.safetensors":        # (cut below)
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = json.loads((src / "config.json").read_text())
    if context is not None:
        config["max_position_embeddings"] = context
    if layers is not None:
        config = with_layers(config, tuple(range(layers)))
        kept = lambda name: not name.startswith("model.layers.") or int(name.split(".")[2]) < layers   # noqa: E731
        tensors = load_file(str(src / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if kept(k)}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# The scripted model's decoder layers: its answers are scripted, so its depth only costs compile time;
# the first two are one of each kind (a DeltaNet and a gated-attention layer, ``ONE_OF_EACH``).
SCRIPTED_LAYERS = 2


def scripted_model(root: Path, template: str, scripts: list[str], context: int | None = None) -> Model:
    """The tiny model (float32; its first ``SCRIPTED_LAYERS`` layers) with ``template``, scripted
    answers ``scripts`` and, if given, a ``context`` other than its own."""
    base = zoo.load(checkpoint_with_template(root, template, context, SCRIPTED_LAYERS), dtype="float32")
    tok = base.tokenizer
    module = ScriptedLM(base.module, [tok.encode(s) for s in scripts], mark=tok.token_to_id(MARK),
                        first_letter=tok.encode("A")[0], eos=tok.eos_token_ids[0])
    return Model(module, base.config, tok, base.load_info)


def sse_events(url: str, body: dict, headers: dict) -> list[tuple[str | None, dict]]:
    """A streaming POST read off the wire: ``[(SSE event name, data)]`` (asserts a 200)."""
    import httpx2 as httpx

    events, name = [], None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events
