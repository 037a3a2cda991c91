"""``zoo.tools.plots``: the audit table and figures computed from real audits of real GGUF files,
the plan's bars from a real plan, each figure saved as a PNG."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict

import numpy as np
import pytest

import zoo
from tests.support.audit_files import BANK, EXPERTS, MATRIX, NORM, ROWS
from tests.support.audit_model_files import LAYERS, quant_types, write_audit_model
from zoo.tools.audit import audit
from zoo.tools.plots import (
    GIB,
    audit_figure,
    audit_table,
    format_audit_table,
    kld_distribution_figure,
    kld_figure,
    per_chip_by_class,
    plan_figure,
    tensor_class,
    throughput_figure,
)

PATTERNS = ["blk.*.ffn_*_exps.weight", "blk.*.attn_*.weight"]


@pytest.fixture(scope="module")
def model_rows(tmp_path_factory):
    quant, ref = write_audit_model(tmp_path_factory.mktemp("audit-model"))
    return audit(quant, ref, PATTERNS, experts=[0, 2], rows=(0, 128))


@pytest.fixture(scope="module")
def flash_plan():
    return zoo.plan("glm53-flash", quant="UD-IQ3_XXS", devices=8, layout="ep")


def saved_png(fig, tmp_path) -> int:
    fig.savefig(tmp_path / "x.png")
    return (tmp_path / "x.png").stat().st_size


def test_tensor_class_strips_the_block_and_weight():
    assert [tensor_class(n) for n in ("blk.12.ffn_down_exps.weight", "blk.0.attn_q.weight", "token_embd.weight",
                                      "output.weight", "blk.3.ssm_a", "blk.7.ssm_dt.bias")] == [
        "ffn_down_exps", "attn_q", "token_embd", "output", "ssm_a", "ssm_dt.bias"]


def test_audit_table_uses_a_banks_all_row(audit_files, tmp_path):
    quant, ref = audit_files
    rows = audit(quant, ref, ["blk.0.ffn_*", "blk.0.attn_*"], experts=EXPERTS, rows=ROWS)
    by = {(r.tensor, r.expert): r for r in rows}
    table = audit_table(rows)
    assert [(t["class"], t["quant_type"], t["ref_type"], t["count"]) for t in table] == [
        ("attn_norm", "F32", "F32", 1), ("attn_q", "Q8_0", "BF16", 1), ("ffn_gate_exps", "Q4_0", "F32", 1)]
    for t, r in zip(table, [by[(NORM, None)], by[(MATRIX, None)], by[(BANK, "all")]]):
        assert (t["rel_frob_median"], t["rel_frob_max"], t["matvec_rel_median"], t["cosine_min"]) == (
            r.rel_frob, r.rel_frob, r.matvec_rel, r.cosine)
    # the per-expert rows are not in it: the bank's max is the pooled value, below the worse expert's
    assert table[2]["rel_frob_max"] < max(by[(BANK, e)].rel_frob for e in EXPERTS)
    # the JSON the CLI writes gives the same table
    assert audit_table(json.loads(json.dumps([asdict(r) for r in rows]))) == table
    text = format_audit_table(table)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["class", "quant", "ref"] and len(lines) == 4
    assert lines[3].split()[:4] == ["ffn_gate_exps", "Q4_0", "F32", "1"]
    assert f"{by[(BANK, 'all')].rel_frob:9.5f}".strip() in lines[3].split()


def test_audit_table_over_layers_equals_a_direct_grouping(model_rows):
    summary = [r for r in model_rows if r.expert in ("all", None)]
    assert len(summary) == 4 * LAYERS and len(model_rows) == 4 * LAYERS + 2 * 2 * LAYERS
    table = audit_table(model_rows)
    expected = {}
    for r in summary:
        expected.setdefault((tensor_class(r.tensor), r.quant_type, r.ref_type), []).append(r)
    assert [(t["class"], t["quant_type"], t["ref_type"]) for t in table] == sorted(expected)
    for t in table:
        members = expected[(t["class"], t["quant_type"], t["ref_type"])]
        assert t["count"] == len(members)
        assert t["rel_frob_median"] == pytest.approx(statistics.median(m.rel_frob for m in members), rel=1e-12)
        assert t["rel_frob_max"] == max(m.rel_frob for m in members)
        assert t["matvec_rel_median"] == pytest.approx(statistics.median(m.matvec_rel for m in members), rel=1e-12)
        assert t["cosine_min"] == min(m.cosine for m in members)
    types = {(t["class"], t["quant_type"]): t["count"] for t in table}
    assert types == {("attn_norm", "F32"): 4, ("attn_q", "Q8_0"): 4, ("ffn_gate_exps", "Q5_1"): 2,
                     ("ffn_gate_exps", "Q4_0"): 2, ("ffn_down_exps", "Q5_0"): 2, ("ffn_down_exps", "MXFP4"): 2}
    worst = {t["class"]: t["rel_frob_max"] for t in table}
    assert worst["attn_norm"] == 0 and worst["attn_q"] < 0.01 < worst["ffn_gate_exps"] < 0.2


@pytest.mark.parametrize("metric", ["rel_frob", "matvec_rel"])
def test_audit_figure_draws_one_series_per_class_and_type(model_rows, metric, tmp_path):
    fig = audit_figure(model_rows, metric=metric)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == metric
    got = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    expected = {}
    for r in model_rows:
        if r.expert not in ("all", None) or r.quant_type == "F32":     # exact copies: rel_frob 0, not drawn
            continue
        layer = int(r.tensor.split(".")[1])
        assert quant_types(layer)[tensor_class(r.tensor)].name == r.quant_type
        xs, ys = expected.setdefault(f"{tensor_class(r.tensor)} {r.quant_type}", ([], []))
        xs.append(layer)
        ys.append(getattr(r, metric))
    assert set(got) == {"attn_q Q8_0", "ffn_gate_exps Q5_1", "ffn_gate_exps Q4_0", "ffn_down_exps Q5_0",
                        "ffn_down_exps MXFP4"}
    for label, (xs, ys) in expected.items():
        order = np.argsort(xs)
        assert got[label][0] == [xs[i] for i in order], label
        np.testing.assert_array_equal(got[label][1], [ys[i] for i in order])
    assert got["attn_q Q8_0"][0] == [0, 1, 2, 3] and got["ffn_down_exps MXFP4"][0] == [1, 2]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in ax.get_lines()]
    assert saved_png(fig, tmp_path) > 0


def test_plan_figure_bars_are_per_chip_gib_by_class(flash_plan, tmp_path):
    by_class = per_chip_by_class(flash_plan)
    assert sum(by_class.values()) == flash_plan.per_device_bytes
    assert set(by_class) == set(flash_plan.by_class)
    assert max(by_class, key=by_class.get) == "routed_experts"
    fig = plan_figure(flash_plan, budget_bytes=16 * GIB)
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    widths = [p.get_width() for p in ax.patches]
    assert sorted(names) == sorted(by_class) and widths == sorted(widths)
    assert widths == pytest.approx([by_class[n] / 2 ** 30 for n in names], rel=1e-12)
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[16.0, 16.0]]
    assert f"{flash_plan.per_device_bytes / 2 ** 30:.2f} GiB" in ax.get_title()
    assert saved_png(fig, tmp_path) > 0
    assert not plan_figure(flash_plan).axes[0].get_lines()          # no budget, no line


def test_throughput_figure_one_line_per_label(tmp_path):
    results = ([{"label": "tp8", "batch": b, "tokens_per_s": 11.0 * b} for b in (8, 1, 4, 32)]
               + [{"label": "ep8", "batch": b, "tokens_per_s": 7.5 * b ** 0.8} for b in (1, 16)])
    fig = throughput_figure(results)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["tp8", "ep8"]
    assert list(lines["tp8"].get_xdata()) == [1, 4, 8, 32]
    assert list(lines["tp8"].get_ydata()) == [11.0, 44.0, 88.0, 352.0]
    assert list(lines["ep8"].get_xdata()) == [1, 16]
    assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [1, 4, 8, 16, 32]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "8", "16", "32"]
    assert saved_png(fig, tmp_path) > 0


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"plots need matplotlib: pip install 'zoo\[notebooks\]'"):
        throughput_figure([])


def test_kld_figures_draw_eval_reports(tmp_path):
    from zoo.eval.figures import figures
    rng = np.random.default_rng(0)
    per_token = {}
    for label, scale in (("Q8_0", 1e-3), ("IQ3_XXS", 5e-2)):
        n = 400
        per_token[label] = {"kld": rng.exponential(scale, n), "kld_bound": np.zeros(n),
                            "base_nll": rng.exponential(2, n), "cand_nll": rng.exponential(2, n),
                            "same_top": rng.random(n) < 1 - 5 * scale,
                            "dp_top": rng.normal(0, scale, n), "dp_next": rng.normal(0, scale, n)}
    reports = {label: figures(pt) for label, pt in per_token.items()}
    fig = kld_figure(reports)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Q8_0", "IQ3_XXS"]
    widths = [p.get_width() for p in ax.patches]
    assert widths == pytest.approx([reports["Q8_0"]["kld"]["mean"], reports["IQ3_XXS"]["kld"]["mean"]])
    assert [t.get_text() for t in ax.texts][0] == f"top-1 {100 * reports['Q8_0']['top1']['mean']:.1f}%"
    assert saved_png(fig, tmp_path) > 10_000
    fig = kld_distribution_figure({label: pt["kld"] for label, pt in per_token.items()})
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["Q8_0", "IQ3_XXS"]
    x, y = lines[1].get_data()
    assert list(x) == sorted(per_token["IQ3_XXS"]["kld"]) and y[0] == 1 and y[-1] == pytest.approx(1 / 400)
    assert saved_png(fig, tmp_path) > 10_000
