"""llama.cpp's quantization figures from per-token values, and their text form.

    figures(per_token) -> dict          per_token: an array [N] for each name of ``PER_TOKEN``
    format_figures(figures) -> str      the report ``zoo eval kld`` prints

Per scored token t (``zoo.eval.windows``) with reference distribution ``p`` and candidate ``q``:

* ``kld``: KL(p || q) in nats, from the stored reference (``zoo.eval.logprob_codec``), and
  ``kld_bound`` the most that can differ from the exact value;
* ``base_nll`` / ``cand_nll``: -log p(x) / -log q(x) of the token x that follows (exact);
* ``same_top``: the reference's most likely token is the candidate's too (exact; a tie in the
  candidate counts as the first of the tied ids, ``np.argmax``);
* ``dp_top``: q(y) - p(y), y the reference's most likely token;
* ``dp_next``: q(x) - p(x), llama.cpp's "delta p" of the token that follows.

The figures (all over the N tokens, uncertainties as llama.cpp: one standard error, the tokens taken
as independent):

* ``kld``: mean ± stderr, median, p90, p99, max, min; ``kld_bound_mean`` / ``kld_bound_max``;
* ``top1``: the share of ``same_top`` ± sqrt(f (1 - f) / (N - 1));
* ``ppl_base``, ``ppl_cand``: exp(mean nll) ± exp(mean nll) * stderr(nll);
* ``ln_ppl_ratio``: mean(cand_nll - base_nll) ± its stderr; ``ppl_ratio`` its exp, ± ratio * that;
  ``ln_ppl_correlation``: Pearson's r of the two nll series;
* ``dp_top_abs``: mean and p99 of |dp_top|; ``dp_next``: mean, RMS.
"""

from __future__ import annotations

import math

import numpy as np

PER_TOKEN = ("kld", "kld_bound", "base_nll", "cand_nll", "same_top", "dp_top", "dp_next")


def _stderr(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def _value(mean: float, stderr: float) -> dict:
    return {"mean": float(mean), "stderr": float(stderr)}


def figures(per_token: dict[str, np.ndarray]) -> dict:
    """The figures of the module doc from ``per_token`` (every key of ``PER_TOKEN``, arrays [N])."""
    missing = [k for k in PER_TOKEN if k not in per_token]
    if missing:
        raise ValueError(f"per-token values missing: {missing}")
    kld = np.asarray(per_token["kld"], np.float64)
    n = len(kld)
    if n == 0:
        raise ValueError("no scored tokens")
    base, cand = (np.asarray(per_token[k], np.float64) for k in ("base_nll", "cand_nll"))
    top1 = float(np.mean(per_token["same_top"]))
    diff = cand - base
    ratio = math.exp(diff.mean())
    dp_top = np.abs(np.asarray(per_token["dp_top"], np.float64))
    dp_next = np.asarray(per_token["dp_next"], np.float64)
    ppl = {name: _value(math.exp(x.mean()), math.exp(x.mean()) * _stderr(x)) for name, x in
           (("ppl_base", base), ("ppl_cand", cand))}
    return {
        "tokens": n,
        "kld": {**_value(kld.mean(), _stderr(kld)), "median": float(np.median(kld)),
                "p90": float(np.percentile(kld, 90)), "p99": float(np.percentile(kld, 99)),
                "max": float(kld.max()), "min": float(kld.min())},
        "kld_bound_mean": float(np.mean(per_token["kld_bound"])),
        "kld_bound_max": float(np.max(per_token["kld_bound"])),
        "top1": _value(top1, math.sqrt(top1 * (1 - top1) / (n - 1)) if n > 1 else float("nan")),
        **ppl,
        "ln_ppl_ratio": _value(diff.mean(), _stderr(diff)),
        "ppl_ratio": _value(ratio, ratio * _stderr(diff)),
        "ln_ppl_correlation": (float(np.corrcoef(base, cand)[0, 1]) if n > 1 and base.std() and cand.std()
                               else float("nan")),
        "dp_top_abs": {"mean": float(dp_top.mean()), "p99": float(np.percentile(dp_top, 99))},
        "dp_next": {"mean": float(dp_next.mean()), "rms": float(np.sqrt(np.mean(dp_next ** 2)))},
    }


def format_figures(f: dict) -> str:
    """The report as text, in llama.cpp's order and wording where it has one."""
    k = f["kld"]
    lines = [
        f"tokens scored: {f['tokens']}",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {f['ppl_cand']['mean']:12.6f} ± {f['ppl_cand']['stderr']:.6f}",
        f"Mean PPL(base)                : {f['ppl_base']['mean']:12.6f} ± {f['ppl_base']['stderr']:.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * f['ln_ppl_correlation']:11.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {f['ln_ppl_ratio']['mean']:12.6f} ± {f['ln_ppl_ratio']['stderr']:.6f}",
        f"Mean PPL(Q)/PPL(base)         : {f['ppl_ratio']['mean']:12.6f} ± {f['ppl_ratio']['stderr']:.6f}",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {k['mean']:12.6f} ± {k['stderr']:.6f}",
        f"Maximum KLD: {k['max']:12.6f}",
        f"99.0%   KLD: {k['p99']:12.6f}",
        f"90.0%   KLD: {k['p90']:12.6f}",
        f"Median  KLD: {k['median']:12.6f}",
        f"Minimum KLD: {k['min']:12.6f}",
        f"(16-bit reference: each token's KLD within {f['kld_bound_mean']:.2e} of exact on average, "
        f"{f['kld_bound_max']:.2e} at most)",
        "====== Token probability statistics ======",
        f"Same top p: {100 * f['top1']['mean']:9.3f} ± {100 * f['top1']['stderr']:.3f} %",
        f"Mean |Δp| of the reference's top token: {100 * f['dp_top_abs']['mean']:8.3f} %",
        f"99.0%  |Δp| of the reference's top token: {100 * f['dp_top_abs']['p99']:6.3f} %",
        f"Mean Δp of the next token     : {100 * f['dp_next']['mean']:8.3f} %",
        f"RMS Δp of the next token      : {100 * f['dp_next']['rms']:8.3f} %",
    ]
    return "\n".join(lines)
