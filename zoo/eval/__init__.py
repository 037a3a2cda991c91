"""``zoo eval``: what a quantization costs in output quality, as llama.cpp's ``llama-perplexity
--kl-divergence`` measures it: KL divergence, top-1 agreement and perplexity against a reference model.

    zoo.eval.base(model, out, *, text=None | tokens=None, ctx=512, chunks=None, batch=1) -> Path
    zoo.eval.kld(model, base, *, text=None | tokens=None, batch=1) -> Report

Two passes, so the two models are never resident together (the reference of a big model needs the
whole chip): ``base`` runs the reference (e.g. ``zoo.load(name, quant="bf16")``) on the evaluation
text and stores what the second pass needs in ``out`` (``zoo.eval.base_file``: the windows, the
reference's log-softmax in 16 bits per vocabulary entry, ``zoo.eval.logprob_codec``, and the exact
log-probabilities the perplexity and top-1 figures use). ``kld`` runs a candidate on the same
windows and returns its ``Report`` (``zoo.eval.figures``). ``model`` is a loaded ``zoo.Model``,
on any mesh. ``text`` is tokenized with the model's tokenizer; ``tokens`` (1-D integer ids) stand
in for it, e.g. for a model without a tokenizer. Windows: ``zoo.eval.windows``. In ``kld`` the text
or tokens are optional: when given, they must cut into exactly the windows of pass 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zoo.eval.base_file import BaseFile
from zoo.eval.figures import figures, format_figures
from zoo.eval.run import score, write_base
from zoo.eval.windows import text_tokens, token_windows

__all__ = ["base", "kld", "Report", "BaseFile"]


def _windows(model, text, tokens, ctx: int, chunks: int | None) -> np.ndarray:
    if (text is None) == (tokens is None):
        raise ValueError("give the evaluation text or its token ids (exactly one of text=, tokens=)")
    ids = text_tokens(model.tokenizer, text) if text is not None else tokens
    return token_windows(ids, ctx, chunks)


def _source(model) -> dict:
    info = model.load_info
    return {"model": str(info.get("path") or info.get("cache_path") or ""), "quant": info.get("quant"),
            "dtype": info.get("dtype")}


@dataclass
class Report:
    """``figures`` (``zoo.eval.figures.figures``), ``per_token`` (its inputs, each [N]), the reference's
    and this model's ``source``s, and ``speed`` of pass 2."""

    figures: dict
    per_token: dict[str, np.ndarray] = field(repr=False)
    base_source: dict
    source: dict
    speed: dict

    def text(self) -> str:
        src = f"reference: {self.base_source}\ncandidate: {self.source}"
        return f"{src}\n{format_figures(self.figures)}\n{self.speed['tokens_per_s']:.1f} tokens/s"

    def to_dict(self) -> dict:
        return {"reference": self.base_source, "candidate": self.source, "figures": self.figures, "speed": self.speed}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def base(model, out: str | Path, *, text: str | None = None, tokens=None, ctx: int = 512, chunks: int | None = None,
         batch: int = 1, progress: bool = True) -> Path:
    """Pass 1 on the reference ``model``: writes ``out`` and returns its path (module doc)."""
    return write_base(model, _windows(model, text, tokens, ctx, chunks), out, source=_source(model), batch=batch,
                      progress=progress)


def kld(model, base: str | Path | BaseFile, *, text: str | None = None, tokens=None, batch: int = 1,
        progress: bool = True) -> Report:
    """Pass 2 on the candidate ``model`` against the reference file ``base`` (module doc)."""
    ref = base if isinstance(base, BaseFile) else BaseFile(base)
    windows = None
    if text is not None or tokens is not None:
        windows = _windows(model, text, tokens, ref.meta["ctx"], ref.meta["windows"])
    per_token, speed = score(model, ref, windows=windows, batch=batch, progress=progress)
    keep = ("model", "quant", "dtype", "ctx", "windows", "scored")
    return Report(figures(per_token), per_token, {k: ref.meta.get(k) for k in keep}, _source(model), speed)
