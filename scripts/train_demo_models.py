"""Train the embedded demo models (qwen38-tiny, glm53-tiny) on the synthetic chat corpus, export them
and measure them. CPU is enough (the models are a few MB); needs the dev extra (the GLM start weights
are drawn through transformers' model, as ``scripts/make_tiny_assets.py`` does).

    PYTHONPATH=. .venv/bin/python scripts/train_demo_models.py [--model qwen38-tiny|glm53-tiny|both]
        [--minutes 15] [--out /tmp/demo-models] [--seed 0] [--eval-per-family 20] [--thinking 0.75]

For each model NAME, under OUT:

    OUT/work/NAME/init/    the start checkpoint: a byte-level BPE tokenizer trained on the corpus
                           (``zoo.train.templates.build_tokenizer``, 512 entries: the model keeps its
                           shapes), ``zoo/configs/NAME.json`` with max_position_embeddings 32768 and the
                           format's end-of-turn ids as eos_token_id, ``DEMO_CONFIG``'s fields, the
                           format's chat template, and fresh random weights (``make_tiny_assets``'
                           draws, same seed; GLM's hyper-connections start as plain residuals,
                           ``residual_init_hyper_connections``)
    OUT/work/NAME/ckpt/    Orbax train states ``step_N`` (+ ``step_N.json``: trained seconds, batches)
                           every ``--ckpt-minutes``; a rerun with the same arguments resumes from the
                           newest one (``--fresh`` starts over)
    OUT/NAME/              the trained model as an HF checkpoint (``zoo.train.export.export_hf``, bf16):
                           config.json, model.safetensors, tokenizer.json, tokenizer_config.json; plus
                           results.json (training curve, held-out numbers) and train_log.jsonl

Training: ``zoo.train.step.Trainer`` with the LM loss and the MTP loss (``--mtp-weight``) on the loss mask of
``zoo.train.corpus.render`` (the assistant's tokens only); AdamW, linear warmup then cosine decay to a tenth
over the *time* budget (the learning rate is an injected hyperparameter set from the fraction of the budget
spent, so the schedule fits whatever steps the machine manages); every batch is fresh examples of the train
split (seeded by the batch index: resuming continues the stream), 45% of them additions (``TRAIN_TASKS``),
packed whole into ``--rows`` x ``--length`` tokens (``batches``; 2 x 256 at a peak learning rate of 2e-3: at a
fixed number of tokens a second, 4x more and smaller steps than 8 x 256 at 5e-3, which on addition alone for 5
minutes took qwen's held-out 2-digit sums with thinking from 0% to 100%). Each model's config is
``zoo/configs/NAME.json`` with ``DEMO_CONFIG``'s fields (``--config`` adds more). With ``--model both`` on a
machine with two or more cores the two models train side by side, each in its own process on its own core
(``side_by_side``; ``--sequential``: one after the other).

Evaluation (after reloading the export with ``zoo.load(OUT/NAME)``, bf16): held-out questions
(``split="eval"``, another seed: keys never trained on), greedy through the real engine (``Model.generate``,
i.e. ``zoo.engine.generator.Generator``) on ``corpus.prompt(example, turn)``; each turn judged by
``corpus.check_answer`` (the server's reasoning and tool-call parsers). Reported: exact-answer accuracy per
family (the final turn; tool families' answers after the given tool result), 2-digit addition apart (goal >=
90%; also split by thinking and direct answers), tool-call turns exact and well-formed (a parseable call with
JSON arguments and no text; goal >= 95%), MTP speculative decoding with 3 draft tokens: acceptance per draft
position, tokens per forward (goal >= 1.5), tokens/s against plain decoding on the same prompts, all in one
batch (``bench/generate.py`` measures the speedup at 4 streams), and the fraction of outputs identical to
plain decoding's (greedy; bf16 verify and decode steps can round a near tie apart).

Time: ``--minutes`` (default 15) of training per model, plus ~3-4 minutes per model for the tokenizer,
start weights, compiles, export and evaluation: ~19 minutes in all for both models side by side on 2
CPU cores. ``--minutes 1`` is a smoke test of the whole pipeline. Copy ``OUT/NAME/`` (without
results.json and train_log.jsonl) to ``zoo/assets/NAME/`` to ship a model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import make_tiny_assets as mta  # noqa: E402

from zoo.train import corpus, templates  # noqa: E402

MODELS = ("qwen38-tiny", "glm53-tiny")
CONTEXT = 32768
# The demo models' own config fields over the tiny presets of zoo/configs/ (which the parity tests use):
# - qwen: rotary over half of each head at theta 1e4 (the preset's quarter at 1e7, Qwen3.8's own,
#   resolves positions too coarsely for a head of 32 to find an operand's digits) and every second
#   layer full attention; measured on addition alone for 5 minutes, the held-out language-model loss
#   went 0.63 -> 0.42 at the same step count.
# - glm: the indexer keeps 512 tokens (the preset: 16). Training gives the indexer no gradient (its
#   top-k selection is not differentiable and GLM-5's indexer is trained by its own distillation
#   loss, which zoo.train does not have), so with 16 an untrained indexer picks 16 of a row's tokens
#   at random and the latent attention cannot see the question; with 512 every demo dialogue is
#   attended whole and longer prompts still go through the sparse selection. ``hc_sinkhorn_iters``
#   4 (GLM-5.3 uses 20): the hyper-connections' Sinkhorn projection is ~10% of a training step at
#   20; at 4 the 15 minutes give 2934 steps instead of 2607, and held-out 2-digit sums with thinking
#   went from 81% to 91%, well-formed tool calls from 91% to 99% (same recipe otherwise).
DEMO_CONFIG: dict[str, dict] = {
    "qwen38-tiny": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                    "full_attention_interval": 2},
    "glm53-tiny": {"index_topk": 512, "hc_sinkhorn_iters": 4},
}


# -- start checkpoint ---------------------------------------------------------------------------------
def make_init(name: str, work: Path, seed: int, overrides: dict | None = None) -> Path:
    """The start checkpoint of ``name`` under ``work/init`` (see the module doc), its config
    ``zoo/configs/NAME.json`` updated with ``overrides``; returns it."""
    init = work / "init"
    if (init / "model.safetensors").is_file():
        return init
    fmt = templates.chat_format(name)
    tok = templates.build_tokenizer(fmt.name, corpus.corpus_text(fmt.name, 3000, seed + 1, split="train"))
    saved_assets = mta.ASSETS
    mta.ASSETS = work                               # make_tiny_assets writes ASSETS/NAME: point it here
    try:
        {"qwen38-tiny": mta.make_qwen, "glm53-tiny": mta.make_glm}[name](overrides)
    finally:
        mta.ASSETS = saved_assets
    if init.exists():
        shutil.rmtree(init)
    (work / name).rename(init)
    if name == "glm53-tiny":
        residual_init_hyper_connections(init / "model.safetensors", json.loads((init / "config.json").read_text())
                                        ["hc_mult"], seed)
    tok.save(init)                                  # our tokenizer and template replace the placeholder's
    cfg = {**json.loads((ROOT / "zoo" / "configs" / f"{name}.json").read_text()), **(overrides or {})}
    if tok._tok.get_vocab_size() > cfg["vocab_size"]:
        raise ValueError(f"the tokenizer has {tok._tok.get_vocab_size()} entries, the model {cfg['vocab_size']}")
    cfg.update(max_position_embeddings=max(CONTEXT, cfg["max_position_embeddings"]),
               eos_token_id=[tok.token_to_id(s) for s in fmt.stops], pad_token_id=tok.token_to_id("<|endoftext|>"))
    (init / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return init


def residual_init_hyper_connections(path: Path, n: int, seed: int) -> None:
    """Rewrite the hyper-connection parameters of the GLM checkpoint ``path`` (``n`` streams, the
    config's ``hc_mult``) so that each mHC starts
    as a plain residual: ``pre = 1/N`` (the collapsed stream is the streams' mean), ``post = 1`` (every
    stream gets the block's output), ``comb`` ~ identity (softmax of 4 on the diagonal, 0 off it), the
    data-dependent part ``fn`` small (std 0.1 of a unit logit) and every base jittered by N(0, 0.1)
    so the streams can part. ``make_tiny_assets``' draws (fn at N(0, 1/fan_in), bases O(0.5), for the
    parity tests) make every layer mix its streams by unit-scale random logits per token, which the
    model must first unlearn: on addition alone for 5 minutes it then never copied an operand."""
    from safetensors.flax import load_file

    rng = np.random.default_rng(seed)
    tensors = {k: np.asarray(v, np.float32) for k, v in load_file(str(path)).items()}
    for key in [k for k in tensors if k.rsplit(".", 1)[-1].startswith("hc_")]:
        kind = key.rsplit("_", 1)[-1]
        t = tensors[key]
        if kind == "fn":
            tensors[key] = 0.1 * rng.standard_normal(t.shape) / np.sqrt(t.shape[1])
        elif kind == "scale":
            tensors[key] = np.ones_like(t)
        elif kind == "base":
            tensors[key] = np.concatenate([np.full(n, math.log(1 / (n - 1)) if n > 1 else 4.0), np.zeros(n),
                                           4.0 * np.eye(n).ravel()]) + 0.1 * rng.standard_normal(t.size)
    mta.write_weights(path.parent, tensors)


# -- data -----------------------------------------------------------------------------------------------
# The families a batch draws from (uniform over this tuple): addition, the headline goal and the
# hardest family to learn, has 10/22 of the dialogues and subtraction 2/22; every other family,
# tool dialogues included, 1/22 each. Evaluation weighs nothing: it reports each family.
TRAIN_TASKS = ("add",) * 10 + ("sub",) * 2 + tuple(f for f in corpus.FAMILIES if f not in ("add", "sub"))


def batches(arch: str, tok, seed: int, start: int = 0, rows: int = 8, length: int = 256, tasks=TRAIN_TASKS,
            thinking: float = 0.5):
    """Endless (index, Batch) of fresh train-split dialogues packed into ``rows`` x ``length`` tokens;
    batch ``i`` depends only on (seed, i).

    Packing: each row is filled first-fit from a buffer of 8 rendered dialogues (a dialogue is placed
    whole, never cut; the buffer refills as it empties; a dialogue longer than ``length``, under 1%,
    is dropped), so ~95% of a batch's tokens are real instead of ~50% with one dialogue a padded row.
    Dialogues in one row see each other through attention (and the linear layers' state), as in
    packed LM training; each starts with its template's own opening tokens, and the loss covers only
    the assistant's tokens of each (``corpus.render``)."""
    from zoo.train.step import Batch
    i = start
    while True:
        draws = iter(range(10 ** 9))

        def draw():
            while True:
                (ex,) = corpus.examples(arch, 1, f"{seed}/{i}/{next(draws)}", tasks, thinking=thinking)
                x, m = corpus.render(ex, None, tok)
                if len(x) <= length:
                    return x, m

        buffer = [draw() for _ in range(8)]
        ids, loss_mask, mask = (np.zeros((rows, length), np.int32) for _ in range(3))
        for r in range(rows):
            pos = 0
            while (j := next((j for j, (x, _) in enumerate(buffer) if len(x) <= length - pos), None)) is not None:
                x, m = buffer.pop(j)
                ids[r, pos:pos + len(x)], loss_mask[r, pos:pos + len(x)], mask[r, pos:pos + len(x)] = x, m, 1
                pos += len(x)
                buffer.append(draw())
        yield i, Batch(ids, loss_mask, mask)
        i += 1


# -- training -----------------------------------------------------------------------------------------
def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``peak / 10`` over the budget."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(name: str, init: Path, work: Path, args) -> tuple[object, list[dict]]:
    import jax.numpy as jnp
    import optax

    import zoo
    from zoo.train import checkpoint
    from zoo.train.step import Trainer

    model = zoo.load(str(init), dtype="float32")
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=args.lr, b1=0.9, b2=0.98, weight_decay=0.01))
    trainer = Trainer(model, opt, mtp_weight=args.mtp_weight)
    ckpt_root, log_file = work / "ckpt", work / "train_log.jsonl"
    state, trained_s, log = None, 0.0, []
    if args.fresh and ckpt_root.exists():
        shutil.rmtree(ckpt_root)
        log_file.unlink(missing_ok=True)
    if (last := checkpoint.latest(ckpt_root)) is not None:
        state = checkpoint.restore(last, trainer.abstract_state())
        trained_s = json.loads(last.with_suffix(".json").read_text())["trained_s"]
        log = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
        print(f"[{name}] resumed from {last} (step {int(state.step)}, {trained_s:.0f} s trained)", flush=True)
    else:
        state = trainer.init()
    budget = 60.0 * args.minutes
    step = int(state.step)
    data = batches(name, model.tokenizer, args.seed, start=step, rows=args.rows, length=args.length,
                   tasks=args.tasks, thinking=args.thinking)
    acc: dict[str, list] = {}
    last_ckpt = time.perf_counter()

    def set_lr(state, lr):
        clip, adam = state.opt_state
        adam = adam._replace(hyperparams={**adam.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)})
        return state._replace(opt_state=(clip, adam))

    while trained_s < budget:
        t0 = time.perf_counter()
        _, batch = next(data)
        lr = lr_at(trained_s / budget, step, args.lr, args.warmup)
        state, metrics = trainer.step(set_lr(state, lr), batch)
        metrics = {k: float(v) for k, v in metrics.items()}
        step += 1
        for k in ("loss", "lm_loss", "lm_accuracy", "mtp_loss", "mtp_accuracy", "grad_norm"):
            acc.setdefault(k, []).append(metrics.get(k, float("nan")))
        acc.setdefault("tokens", []).append(int(np.asarray(batch.mask).sum()))
        trained_s += time.perf_counter() - t0
        if step % args.log_every == 0 or step == 1 or trained_s >= budget:
            row = {"step": step, "trained_s": round(trained_s, 1), "lr": lr,
                   **{k: round(float(np.mean(v)), 4) for k, v in acc.items() if k != "tokens"},
                   "tokens_per_s": round(sum(acc["tokens"]) / max(1e-9, trained_s - (log[-1]["trained_s"]
                                                                                  if log else 0.0)), 1)}
            acc = {}
            log.append(row)
            with log_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{name}] step {step:5d} {trained_s:6.0f}s lr {lr:.2e} loss {row['loss']:.3f} "
                  f"lm {row['lm_loss']:.3f} ({row['lm_accuracy']:.3f}) mtp {row['mtp_loss']:.3f} "
                  f"({row['mtp_accuracy']:.3f}) {row['tokens_per_s']:.0f} tok/s", flush=True)
        if time.perf_counter() - last_ckpt > 60 * args.ckpt_minutes or trained_s >= budget:
            path = checkpoint.save_step(ckpt_root, state)
            path.with_suffix(".json").write_text(json.dumps({"trained_s": trained_s, "step": step}))
            for old in ckpt_root.glob("step_*"):          # keep the newest only
                if old.is_dir() and old != path:
                    shutil.rmtree(old)
                    old.with_suffix(".json").unlink(missing_ok=True)
            last_ckpt = time.perf_counter()
    return trainer.merged(state), log


# -- evaluation ---------------------------------------------------------------------------------------
def well_formed_call(example, text: str, turn: int = 0) -> bool:
    """Does ``text`` (a tool turn's output) parse, as the server parses it (``corpus.parse_turn``), into
    exactly one call with JSON-object arguments and no other text (whatever the call)?"""
    answer, calls = corpus.parse_turn(example, text, turn)
    if answer or len(calls) != 1:
        return False
    try:
        return isinstance(json.loads(calls[0][1]), dict)
    except ValueError:
        return False


def two_digit_sum(example) -> bool:
    """Is ``example`` an addition whose operands both have two digits?"""
    return example.family == "add" and all(int(v) < 100 for v in example.key.split(":")[1:])


def add2_sweep(model, arch: str, n: int, seed: int, max_new_tokens: int) -> dict:
    """Held-out 2-digit additions only (both operands 10..99), ``n`` asked with thinking and ``n``
    without, greedy in one batch: {"n", "thinking", "direct"} accuracies by ``corpus.check_answer``."""
    out = {"n": n}
    for mode, thinking in (("thinking", 1.0), ("direct", 0.0)):
        exs = [ex for ex in corpus.examples(arch, 8 * n, seed, ("add",), split="eval", thinking=thinking)
               if two_digit_sum(ex)][:n]
        gens = model.generate([model.tokenizer.encode(corpus.prompt(ex)) for ex in exs],
                              max_new_tokens=max_new_tokens, temperature=0.0)
        out[mode] = sum(corpus.check_answer(ex, model.tokenizer.decode(g.tokens, skip_special_tokens=False))
                        for ex, g in zip(exs, gens)) / len(exs)
    return out


def evaluate(name: str, path: Path, args) -> dict:
    import zoo
    model = zoo.load(str(path))
    tok = model.tokenizer
    arch = templates.chat_format(name).name
    jobs = []                                       # (example, turn)
    for fam in [f for f in corpus.FAMILIES if f in args.tasks]:
        n = args.eval_per_family * (3 if fam == "add" else 1)
        for ex in corpus.examples(arch, n, args.seed + 1000 + len(jobs), (fam,), split="eval"):
            jobs += [(ex, t) for t in range(len(ex.turns()))]
    prompts = [tok.encode(corpus.prompt(ex, t)) for ex, t in jobs]
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
    model.generate([prompts[0]], max_new_tokens=4)                  # compile outside the timings
    model.generate([prompts[0]], max_new_tokens=4, spec_tokens=args.spec_tokens)
    runs = {}
    for k in (0, args.spec_tokens):
        t0 = time.perf_counter()
        outs = model.generate(prompts, spec_tokens=k, **gen)
        wall = time.perf_counter() - t0
        runs[k] = (outs, wall, sum(len(o.tokens) for o in outs))
    outs = runs[0][0]
    per_family: dict[str, dict] = {}
    calls = {"turns": 0, "exact": 0, "well_formed": 0}
    add2_mode = {True: [0, 0], False: [0, 0]}       # thinking -> [n, correct] of the 2-digit sums
    samples = []
    for (ex, turn), out in zip(jobs, outs):
        text = tok.decode(out.tokens, skip_special_tokens=False)
        ok = corpus.check_answer(ex, text, turn)
        is_call = bool(ex.messages[ex.turns()[turn]].get("tool_calls"))
        if is_call:
            calls["turns"] += 1
            calls["exact"] += ok
            calls["well_formed"] += well_formed_call(ex, text, turn)
        if turn == len(ex.turns()) - 1:
            f = per_family.setdefault(ex.family, {"n": 0, "correct": 0})
            f["n"] += 1
            f["correct"] += ok
            if two_digit_sum(ex):
                add2_mode[ex.thinking][0] += 1
                add2_mode[ex.thinking][1] += ok
        if len(samples) < 40 and not ok:
            samples.append({"family": ex.family, "turn": turn, "question": ex.question, "want": ex.answer,
                            "got": text[-300:]})
    for f in per_family.values():
        f["accuracy"] = f["correct"] / f["n"]
    add2 = [sum(v) for v in zip(*add2_mode.values())]
    sweep = add2_sweep(model, arch, args.eval_add2, args.seed + 2000, args.max_new_tokens) \
        if "add" in args.tasks and args.eval_add2 else None
    spec_outs, spec_wall, spec_tokens = runs[args.spec_tokens]
    same = sum(a.tokens == b.tokens for a, b in zip(outs, spec_outs))
    k = args.spec_tokens
    steps = sum(o.stats["steps"] for o in spec_outs)
    drafted = sum(o.stats["drafted"] for o in spec_outs)
    by_pos = np.sum([o.stats["accepted_by_position"] for o in spec_outs], axis=0).tolist()
    spec_steps = drafted // k if k else 0
    total = sum(f["n"] for f in per_family.values())
    return {
        "eval_examples": len({id(ex) for ex, _ in jobs}), "eval_turns": len(jobs),
        "accuracy": sum(f["correct"] for f in per_family.values()) / total,
        "per_family": per_family,
        "add_2digit": {"n": add2[0], "correct": add2[1], "accuracy": add2[1] / max(1, add2[0]),
                       **{f"accuracy_{'thinking' if t else 'direct'}": c / max(1, n)
                          for t, (n, c) in add2_mode.items()}, "sweep": sweep},
        "tool_calls": {**calls, "exact_rate": calls["exact"] / max(1, calls["turns"]),
                       "well_formed_rate": calls["well_formed"] / max(1, calls["turns"])},
        "spec": {"spec_tokens": k, "drafted": drafted, "accepted": sum(o.stats["accepted"] for o in spec_outs),
                 "accepted_by_position": by_pos,
                 "acceptance_by_position": [a / max(1, spec_steps) for a in by_pos],
                 "steps": steps, "tokens": spec_tokens, "tokens_per_forward": spec_tokens / max(1, steps),
                 "spec_tokens_per_s": spec_tokens / spec_wall, "plain_tokens_per_s": runs[0][2] / runs[0][1],
                 "speedup": (spec_tokens / spec_wall) / (runs[0][2] / runs[0][1]),
                 "identical_outputs": same / len(jobs)},
        "failures": samples,
    }


def run(name: str, args) -> dict:
    from zoo.train.export import export_hf
    work = args.out / "work" / name
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    config = {**DEMO_CONFIG.get(name, {}), **json.loads(args.config)}
    init = make_init(name, work, args.seed, config)
    print(f"[{name}] start checkpoint {init} ({time.perf_counter() - t0:.0f} s)", flush=True)
    module, log = train(name, init, work, args)
    out = args.out / name
    if out.exists():
        shutil.rmtree(out)
    export_hf(module, init, out, dtype="bfloat16")
    shutil.copy2(work / "train_log.jsonl", out / "train_log.jsonl")
    print(f"[{name}] exported {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB)", flush=True)
    t1 = time.perf_counter()
    ev = evaluate(name, out, args)
    results = {
        "model": name, "seed": args.seed, "minutes": args.minutes, "mtp_weight": args.mtp_weight, "lr": args.lr,
        "rows": args.rows, "length": args.length, "thinking": args.thinking, "tasks": args.tasks,
        "config": config,
        "steps": log[-1]["step"] if log else 0, "trained_s": log[-1]["trained_s"] if log else 0,
        "loss_start": log[0] if log else None, "loss_end": log[-1] if log else None,
        "model_safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "eval_s": round(time.perf_counter() - t1, 1), **ev}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table(results)
    return results


def table(r: dict) -> None:
    s = r["spec"]
    print(f"\n== {r['model']}: {r['steps']} steps in {r['trained_s']:.0f} s; loss {r['loss_start']['loss']:.3f} -> "
          f"{r['loss_end']['loss']:.3f} (lm {r['loss_end']['lm_loss']:.3f}, acc {r['loss_end']['lm_accuracy']:.3f}; "
          f"mtp {r['loss_end']['mtp_loss']:.3f}, acc {r['loss_end']['mtp_accuracy']:.3f})")
    print(f"{'family':14s} {'n':>4s} {'acc':>6s}")
    for fam, f in r["per_family"].items():
        print(f"{fam:14s} {f['n']:4d} {f['accuracy']:6.1%}")
    a = r["add_2digit"]
    print(f"{'add 2-digit':14s} {a['n']:4d} {a['accuracy']:6.1%}   (goal >= 90%; thinking "
          f"{a['accuracy_thinking']:.1%}, direct {a['accuracy_direct']:.1%})")
    if a.get("sweep"):
        w = a["sweep"]
        print(f"{'  sweep':14s} {w['n']:4d} thinking {w['thinking']:.1%}, direct {w['direct']:.1%}   "
              "(2-digit only, each mode)")
    print(f"{'all':14s} {sum(f['n'] for f in r['per_family'].values()):4d} {r['accuracy']:6.1%}")
    c = r["tool_calls"]
    print(f"tool-call turns {c['turns']}: exact {c['exact_rate']:.1%}, well-formed {c['well_formed_rate']:.1%} "
          "(goal >= 95%)")
    print(f"MTP k={s['spec_tokens']}: acceptance by position "
          + ", ".join(f"{a:.2f}" for a in s["acceptance_by_position"])
          + f"; {s['tokens_per_forward']:.2f} tokens/forward (goal >= 1.5); {s['spec_tokens_per_s']:.0f} vs "
          f"{s['plain_tokens_per_s']:.0f} tok/s plain ({s['speedup']:.2f}x); identical outputs "
          f"{s['identical_outputs']:.1%}; model.safetensors {r['model_safetensors_bytes'] / 1e6:.2f} MB\n", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=(*MODELS, "both"), default="both")
    p.add_argument("--minutes", type=float, default=15.0, help="training time budget per model")
    p.add_argument("--out", type=Path, default=Path("/tmp/demo-models"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rows", type=int, default=2, help="rows a batch")
    p.add_argument("--length", type=int, default=256, help="tokens a row (dialogues packed whole)")
    p.add_argument("--mtp-weight", type=float, default=0.7)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--ckpt-minutes", type=float, default=2.0)
    p.add_argument("--config", default="{}", help="JSON: config fields over DEMO_CONFIG's (a new start "
                   "checkpoint: use a new --out)")
    p.add_argument("--tasks", default=",".join(TRAIN_TASKS), help="comma-separated families a batch draws "
                   "from, repeated to weight one (default: TRAIN_TASKS)")
    p.add_argument("--thinking", type=float, default=0.75,
                   help="the fraction of training dialogues rendered with enable_thinking")
    p.add_argument("--fresh", action="store_true", help="ignore earlier checkpoints of the run")
    p.add_argument("--eval-per-family", type=int, default=20, help="held-out dialogues a family (add: 3x)")
    p.add_argument("--eval-add2", type=int, default=100,
                   help="held-out 2-digit additions asked in each mode, thinking and direct (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--sequential", action="store_true",
                   help="with --model both: train one model after the other on all cores (default: side by "
                        "side, one process a model, each on its own core, when the machine has two or more)")
    args = p.parse_args()
    args.out = args.out.absolute()
    args.tasks = tuple(args.tasks.split(","))
    names = MODELS if args.model == "both" else (args.model,)
    cores = sorted(os.sched_getaffinity(0))
    if len(names) > 1 and not args.sequential and len(cores) >= len(names):
        results = side_by_side(names, cores, args)
    else:
        results = [run(name, args) for name in names]
    (args.out / "summary.json").write_text(json.dumps(
        {r["model"]: {k: v for k, v in r.items() if k != "failures"} for r in results}, indent=2) + "\n")


def side_by_side(names, cores, args) -> list[dict]:
    """Each model in its own process of this script (``--model NAME``, the same other arguments),
    pinned to one core with XLA's CPU backend single-threaded: a model this small runs a training step
    about as fast on one core as on two (its ops are too small to split), so two models side by side
    train twice as long in the same wall time. Returns their results.json."""
    argv = list(sys.argv[1:])
    if "--model" in argv:
        k = argv.index("--model")
        del argv[k:k + 2]
    argv = [a for a in argv if not a.startswith("--model=")]
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                       "intra_op_parallelism_threads=1").strip(), "JAX_PLATFORMS": "cpu"}
    procs = []
    for name, core in zip(names, cores):
        procs.append(subprocess.Popen([sys.executable, __file__, "--model", name, *argv], env=env,
                                      preexec_fn=lambda core=core: os.sched_setaffinity(0, {core})))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"training failed: exit codes {dict(zip(names, codes))}")
    return [json.loads((args.out / name / "results.json").read_text()) for name in names]

if __name__ == "__main__":
    main()
