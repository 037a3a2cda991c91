"""The two passes of ``zoo eval`` over a loaded ``zoo.Model`` (any mesh: ``Model.logits`` runs there).

    write_base(model, windows, out, *, source, batch=1, progress=True) -> Path        pass 1
    score(model, base, *, windows=None, batch=1, progress=True) -> (per_token, speed)  pass 2
    check_same_inputs(base, model, windows=None)

Both run the model's full forward (no cache) on ``batch`` windows at a time; a last, short batch is
padded with copies of its last window, so a pass compiles one program whatever the window count.
The log-softmax and every figure are computed in float64 on the host from the float32 logits.
``speed`` is ``{"seconds", "tokens_per_s"}``, tokens being every token of every window forwarded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from zoo.eval.base_file import BaseFile, BaseWriter
from zoo.eval.logprob_codec import decode, encode, kld_bound, log_softmax
from zoo.eval.windows import check_ids, scored_positions, tokenizer_fingerprint


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, file=sys.stderr, disable=not enabled)


def _window_logprobs(model, windows: np.ndarray, batch: int, desc: str, progress: bool):
    """Yield ``(w, logprobs float64 [scored, V])`` for every window ``w`` in order."""
    count, ctx = windows.shape
    first, scored = scored_positions(ctx)
    with _progress(count * ctx, desc, progress) as bar:
        for start in range(0, count, batch):
            rows = windows[start:start + batch]
            padded = np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows), axis=0)])
            logits = model.logits(padded)
            for i in range(len(rows)):
                yield start + i, log_softmax(logits[i, first:first + scored])
            bar.update(len(rows) * ctx)


def _next_tokens(windows: np.ndarray, w: int) -> np.ndarray:
    first, scored = scored_positions(windows.shape[1])
    return windows[w, first + 1:first + 1 + scored]


def write_base(model, windows: np.ndarray, out: str | Path, *, source: dict, batch: int = 1,
               progress: bool = True) -> Path:
    """Pass 1: score ``windows`` (int32 [W, ctx], ``zoo.eval.windows.token_windows``) with the reference
    ``model`` and write ``out`` (``zoo.eval.base_file``); ``source`` describes the model for the meta."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    vocab = int(model.config.vocab_size)
    check_ids(windows, vocab)
    first, scored = scored_positions(windows.shape[1])
    meta = {**source, "ctx": int(windows.shape[1]), "first": first, "scored": scored,
            "tokenizer": tokenizer_fingerprint(model.tokenizer)}
    rows = np.arange(scored)
    with BaseWriter(out, meta, windows, vocab) as writer:
        for w, lp in _window_logprobs(model, windows, batch, "reference", progress):
            writer.add(encode(lp), lp[rows, _next_tokens(windows, w)])
    return Path(out)


def check_same_inputs(base: BaseFile, model, windows: np.ndarray | None = None) -> None:
    """``ValueError`` unless ``model`` can be scored against ``base``: the same vocabulary size, the
    same tokenizer (vocabulary fingerprint), and, when ``windows`` (the evaluation text cut again) is
    given, exactly the windows pass 1 scored."""
    vocab = int(model.config.vocab_size)
    if vocab != base.vocab:
        raise ValueError(f"the model's vocabulary has {vocab} tokens, the reference's ({base.path}) {base.vocab}")
    theirs, ours = base.meta.get("tokenizer"), tokenizer_fingerprint(model.tokenizer)
    if theirs != ours and windows is None:
        if theirs is not None and ours is not None:
            raise ValueError(f"the model's tokenizer differs from the reference's (vocabulary sha256 {ours[:12]} "
                             f"against {theirs[:12]} in {base.path}): both passes must score the same token ids")
        raise ValueError(f"only one of the two models has a tokenizer ({base.path}: "
                         f"{'yes' if theirs else 'no'}; this model: {'yes' if ours else 'no'}): "
                         f"give the evaluation text or tokens again, to check the windows")
    if windows is not None:
        if windows.shape != base.windows.shape:
            raise ValueError(f"the text cuts into {windows.shape[0]} windows of {windows.shape[1]} tokens, the "
                             f"reference scored {base.windows.shape[0]} of {base.windows.shape[1]}")
        differ = np.argwhere(windows != base.windows)
        if len(differ):
            w, t = (int(i) for i in differ[0])
            raise ValueError(f"the text tokenizes differently from the reference's: window {w}, position {t} is "
                             f"token {int(windows[w, t])} here, {int(base.windows[w, t])} in {base.path}")


def score(model, base: BaseFile, *, windows: np.ndarray | None = None, batch: int = 1,
          progress: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """Pass 2: the candidate ``model`` on the reference's windows -> per-token values
    (``zoo.eval.figures.PER_TOKEN``, each [N]) and the speed."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    check_same_inputs(base, model, windows)
    scored = base.scored
    rows = np.arange(scored)
    out = {name: [] for name in ("kld", "kld_bound", "cand_nll", "same_top", "dp_top", "dp_next")}
    t0 = time.perf_counter()
    references = base.window_encoded()
    for w, q in _window_logprobs(model, base.windows, batch, "candidate", progress):
        at = slice(w * scored, (w + 1) * scored)
        ref = next(references)
        p, shift = decode(ref)
        nxt, top = _next_tokens(base.windows, w), ref.top_ids[:, 0]
        out["kld"].append((np.exp(p) * (p - q)).sum(axis=-1))
        out["kld_bound"].append(kld_bound(ref, shift, p, q))
        out["cand_nll"].append(-q[rows, nxt])
        out["same_top"].append(q.argmax(axis=-1) == top)
        out["dp_top"].append(np.exp(q[rows, top]) - np.exp(ref.top_logprobs[:, 0]))
        out["dp_next"].append(np.exp(q[rows, nxt]) - np.exp(base.next_logprob[at]))
    seconds = time.perf_counter() - t0
    per_token = {name: np.concatenate(parts) for name, parts in out.items()}
    per_token["base_nll"] = -np.asarray(base.next_logprob, np.float64)
    return per_token, {"seconds": seconds, "tokens_per_s": base.windows.size / seconds}
