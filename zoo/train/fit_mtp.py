"""Fit an MTP head to a model *as loaded* by self-distillation; save it as an MTP overlay.

    result = fit_mtp(model, prompts=None, steps=200, new_tokens=32, lr=1e-3, trainable=("mtp.*",))
    result.model           a ``zoo.Model``: the loaded one with the fitted MTP parameters (as ``zoo.load``
                           would give them with the overlay: dense, in the model's dtype)
    result.report          {"before", "after": acceptance (``acceptance``), "loss", "trainable", ...}
    save_overlay(result, out_dir) -> manifest      ``zoo.load(..., mtp=out_dir)`` applies it

The model writes its own training data: it continues the training prompts (greedy, or sampled with
``temperature``) through the real speculative decoder (``Generator(model, spec_tokens=k,
spec_policy="fixed")``: k MTP drafts every step, whose output is plain decoding's), which also
measures the acceptance *before* on the held-out
prompts of the same run. The MTP layer is then trained on prompt + continuation with the main model
frozen (``Trainer(trainable=..., lm_weight=0, mtp_weight=1, detach_hidden=True, mtp_teacher=T)``):
each row's target is the main model's own prediction there, what the verify step will compare the
draft with (its argmax for ``temperature`` 0, else its distribution at that temperature), on the
prompt's rows too (``prompt_rows``). The acceptance *after* is measured again on the held-out prompts
with the fitted parameters as ``zoo.load(..., mtp=DIR)`` gives them (cast to the model's dtype).

Quantized models (a recipe, a GGUF): the main model is used as stored. The trainable MTP parameters
(``trainable``: globs, each matching only ``mtp.*`` paths) are trained as float32: a quantized one
(``QArray``, ``Int8Weight``) is dequantized first, a dense one cast; choose globs that leave large
quantized parts (a MoE MTP layer's experts) out, and they stay frozen as loaded. A model loaded
without an MTP layer gets a new one (``new_mtp_values``), trained and saved whole.

Prompts (token-id lists): ``prompts`` given, or the synthetic corpus's questions
(``zoo.train.corpus``: training split to fit, held-out split to measure) rendered with the model's
chat template (plain text without one; seeded random tokens for a model without a tokenizer).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo.api import Model
from zoo.engine.generator import Generator
from zoo.loader.overlay import abstract_model, checkpoint_files, dotted, rebuild, write_overlay
from zoo.models.architectures import architecture
from zoo.quant.int8 import Int8Weight
from zoo.quant.qarray import QArray
from zoo.sources.safetensors import SafetensorsSource
from zoo.train.export import export_tensors
from zoo.train.select import split_trainable
from zoo.train.step import Batch, Trainer


@dataclasses.dataclass
class FitResult:
    """``model``: the fitted ``zoo.Model``; ``trained``: the float32 training module; ``params``: the
    parameter paths an overlay holds; ``complete``: they are the whole MTP layer; ``report``: see
    ``fit_mtp``."""
    model: Model
    trained: nnx.Module
    params: list[str]
    complete: bool
    report: dict


def encode_prompts(model, texts: list[str]) -> list[list[int]]:
    """Each text as a user turn in the model's chat template (plain text without one)."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer: give prompts as token ids")
    if tok.chat_template is None:
        return [tok.encode(t) for t in texts]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def default_prompts(model, n: int, seed: int, split: str) -> list[list[int]]:
    """``n`` prompts: the corpus's questions of ``split`` ("train" | "eval"), or random tokens."""
    from zoo.train import corpus
    if model.tokenizer is None:
        rng = np.random.default_rng([seed, split == "eval"])
        return [rng.integers(0, model.config.vocab_size, 24).tolist() for _ in range(n)]
    arch = model.config.arch if model.config.arch.startswith(("qwen", "glm")) else "qwen"
    return encode_prompts(model, [e.question for e in corpus.examples(arch, n, seed, split=split)])


def acceptance(outputs, spec_tokens: int) -> dict:
    """Acceptance of the speculative decoder over ``outputs`` (``Generation``s): ``rate`` accepted /
    drafted, ``by_position[i]``: the fraction of steps whose draft i was accepted, tokens per step."""
    if bad := [o.stats.get("error") for o in outputs if o.finish_reason == "error"]:
        raise RuntimeError(f"generation failed: {bad[0]}")
    drafted, accepted = sum(o.stats["drafted"] for o in outputs), sum(o.stats["accepted"] for o in outputs)
    by_pos = np.sum([o.stats["accepted_by_position"] for o in outputs], axis=0)
    spec_steps = max(drafted // spec_tokens, 1)
    return {"spec_tokens": spec_tokens, "rate": accepted / max(drafted, 1), "drafted": drafted,
            "accepted": accepted, "by_position": [round(float(b) / spec_steps, 4) for b in by_pos],
            "tokens_per_step": sum(len(o.tokens) - 1 for o in outputs) / max(sum(o.stats["steps"] for o in outputs), 1)}


def new_mtp_values(module: nnx.Module, cfg) -> dict:
    """Starting values of a new MTP layer (``cfg`` with one, ``module`` without): each block parameter
    ``mtp.block.X`` from ``layers.N.X`` of the last main layer holding X with the same shape (the
    block is a decoder layer of the model), the three norms from the final norm, and ``fc`` = [0; I]
    (the block first sees the main model's normalized hidden state)."""
    have = {dotted(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg, module.dtype), nnx.Param)):
        name, shape = dotted(path), tuple(var.get_value().shape)
        if name == "mtp.fc.kernel":
            d = shape[1]
            values[name] = jnp.concatenate([jnp.zeros((d, d), jnp.float32), jnp.eye(d, dtype=jnp.float32)])
        elif name in ("mtp.embed_norm.weight", "mtp.hidden_norm.weight", "mtp.final_norm.weight"):
            values[name] = have["norm.weight"]
        elif name.startswith("mtp.block."):
            rest = name[len("mtp.block."):]
            donors = [k for k in have if k.startswith("layers.") and k.split(".", 2)[2] == rest
                      and tuple(have[k].shape) == shape]
            if not donors:
                raise ValueError(f"cannot start a new MTP layer: no main layer has a parameter {rest} of shape {shape}")
            values[name] = have[max(donors, key=lambda k: int(k.split(".")[1]))]
        elif name.startswith("mtp."):
            raise ValueError(f"cannot start a new MTP layer: no starting value for {name}")
    return values


def _float32(path: str, value) -> jax.Array:
    if isinstance(value, QArray):
        return value.dequantize().astype(jnp.float32)
    if isinstance(value, Int8Weight):
        return value.dequantize(jnp.float32)
    if isinstance(value, (jax.Array, np.ndarray)):
        return jnp.asarray(value, jnp.float32)
    raise TypeError(f"{path} is stored as {type(value).__name__}, which cannot be trained")


def _training_model(model, trainable) -> tuple[Model, list[str], list[str], bool]:
    """(the model to train: MTP layer present, trainable parameters float32; trainable paths;
    overlay paths; whether the MTP layer is new)."""
    cfg, module, fresh = model.config, model.module, getattr(model.module, "mtp", None) is None
    values = {}
    if fresh:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
        values = new_mtp_values(module, cfg)
        module = rebuild(module, cfg, values, model.mesh)
    _, params, _ = split_trainable(module, trainable)
    paths = [dotted(p) for p, _ in nnx.to_flat_state(params)]
    if outside := [p for p in paths if not p.startswith("mtp.")]:
        raise ValueError(f"fit_mtp trains MTP parameters only; {trainable!r} also matches {outside[:3]}")
    current = {dotted(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    overlay = sorted(set(paths) | (set(values) if fresh else set()))
    module = rebuild(module, cfg, {p: _float32(p, current[p]) for p in overlay}, model.mesh)
    return Model(module, cfg, model.tokenizer, dict(model.load_info), mesh=model.mesh), paths, overlay, fresh


def _sequences(prompts, outputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt + continuation per row, right-padded: (ids, loss_mask on the continuation, mask)."""
    rows = [(list(p), list(o.tokens)) for p, o in zip(prompts, outputs)]
    t = -(-max(len(p) + len(c) for p, c in rows) // 8) * 8
    ids, loss_mask, mask = (np.zeros((len(rows), t), dt) for dt in (np.int32, bool, bool))
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = p + c
        loss_mask[i, len(p):len(p) + len(c)] = True
        mask[i, :len(p) + len(c)] = True
    return ids, loss_mask, mask


def fit_mtp(model, prompts=None, eval_prompts=None, *, steps: int = 200, new_tokens: int = 32, lr: float = 1e-3,
            trainable=("mtp.*",), batch: int = 8, seed: int = 0, spec_tokens: int = 2, temperature: float = 0.0,
            n_prompts: int = 64, n_eval: int = 8, prompt_rows: bool = True, log=None) -> FitResult:
    """Fit ``model``'s MTP layer to ``model`` itself (see the module docstring). ``prompts`` /
    ``eval_prompts``: token-id lists to fit on / measure on (default: ``n_prompts`` / ``n_eval`` of
    ``default_prompts``); ``steps`` Adam updates of ``batch`` rows at learning rate ``lr``;
    ``new_tokens`` generated per prompt; ``spec_tokens`` k of the measuring decoder; ``log``: called
    with a line of progress. ``report``: before / after (``acceptance``; before is None for a model
    without an MTP layer), loss and MTP accuracy at the first and last step, the settings, seconds."""
    if spec_tokens < 1 or steps < 0 or batch < 1:
        raise ValueError(f"fit_mtp needs spec_tokens >= 1, steps >= 0, batch >= 1; got {spec_tokens}, {steps}, "
                         f"{batch}")
    t0, say = time.perf_counter(), log or (lambda line: None)
    prompts = default_prompts(model, n_prompts, seed, "train") if prompts is None else prompts
    eval_prompts = default_prompts(model, n_eval, seed, "eval") if eval_prompts is None else eval_prompts
    if not prompts or not eval_prompts:
        raise ValueError("fit_mtp needs training and held-out prompts")
    train_model, paths, overlay, fresh = _training_model(model, trainable)
    say(f"{'new MTP layer; ' if fresh else ''}{len(paths)} trainable MTP parameters; generating "
        f"{len(prompts)} + {len(eval_prompts)} continuations of {new_tokens} tokens")
    first = Generator(train_model if fresh else model, spec_tokens=spec_tokens, spec_policy="fixed", prefix_cache=0)
    outs = first.generate(list(prompts) + list(eval_prompts), max_new_tokens=new_tokens, temperature=temperature,
                          seed=seed)
    before = None if fresh else acceptance(outs[len(prompts):], spec_tokens)
    ids, loss_mask, mask = _sequences(prompts, outs[:len(prompts)])
    t_data = time.perf_counter()
    trainer = Trainer(train_model, optax.adam(lr), trainable=paths, lm_weight=0.0, mtp_weight=1.0, detach_hidden=True,
                      mtp_teacher=temperature)
    loss_mask = mask if prompt_rows else loss_mask
    state, history, order, rng = trainer.init(), [], [], np.random.default_rng(seed)
    batch = min(batch, len(ids))
    for step in range(steps):
        if len(order) < batch:
            order += rng.permutation(len(ids)).tolist()
        rows, order = order[:batch], order[batch:]
        state, metrics = trainer.step(state, Batch(ids[rows], loss_mask[rows], mask[rows]))
        if step in (0, steps - 1) or (step + 1) % max(steps // 5, 1) == 0:
            history.append({"step": step, **{k: round(float(metrics[k]), 4) for k in ("mtp_loss", "mtp_accuracy")}})
            say(f"step {step + 1}/{steps}: mtp loss {history[-1]['mtp_loss']:.3f}, "
                f"accuracy {history[-1]['mtp_accuracy']:.3f}")
    t_train = time.perf_counter()
    trained = trainer.merged(state)
    current = {dotted(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(trained, nnx.Param))}
    dtype = model.module.dtype
    fitted = rebuild(trained, train_model.config, {p: current[p].astype(dtype) for p in overlay}, model.mesh)
    fitted_model = Model(fitted, train_model.config, model.tokenizer, dict(model.load_info), mesh=model.mesh)
    outs = Generator(fitted_model, spec_tokens=spec_tokens, spec_policy="fixed", prefix_cache=0).generate(
        list(eval_prompts), max_new_tokens=new_tokens, temperature=temperature, seed=seed)
    after = acceptance(outs, spec_tokens)
    summary = (f"acceptance (k={spec_tokens}) {_rate(before)} -> {_rate(after)}, by draft position "
               f"{None if before is None else before['by_position']} -> {after['by_position']}")
    report = {"before": before, "after": after, "summary": summary, "new_mtp_layer": fresh,
              "trainable": list(trainable) if not isinstance(trainable, str) else [trainable],
              "trained_parameters": len(paths), "overlay_parameters": len(overlay), "steps": steps, "lr": lr,
              "batch": batch, "new_tokens": new_tokens, "temperature": temperature, "seed": seed,
              "prompts": {"train": len(prompts), "eval": len(eval_prompts), "train_rows": int(loss_mask.sum())},
              "history": history, "seconds": {"data": round(t_data - t0, 2), "train": round(t_train - t_data, 2),
                                              "total": round(time.perf_counter() - t0, 2)}}
    return FitResult(fitted_model, trained, overlay, fresh or overlay == _mtp_paths(trained), report)


def _rate(acc: dict | None) -> str:
    return "none" if acc is None else f"{acc['rate']:.2f}"


def _mtp_paths(module) -> list[str]:
    return sorted(dotted(p) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)) if p[0] == "mtp")


def save_overlay(result: FitResult, out_dir, base_name: str | None = None) -> dict:
    """Write ``result``'s MTP parameters (float32, as trained) as an overlay directory
    (``zoo.loader.overlay``): named as in the base checkpoint where it is a safetensors directory
    holding them, else by the name map (``zoo.train.export``). Returns the manifest."""
    cfg, info = result.model.config, result.model.load_info
    name_map = architecture(cfg.arch).hf_name_map(cfg)
    path = info.get("path")
    template = SafetensorsSource(path) if info.get("format") == "safetensors" and path else None
    tensors = export_tensors(result.trained, name_map, select=result.params, template=template, dtype="float32")
    params = {k: name_map.resolve(k).path for k in tensors}
    base = {"model": base_name or path, "path": path, "format": info.get("format"), "quant": info.get("quant"),
            "dtype": info.get("dtype"), "files": checkpoint_files(path) if path else None}
    return write_overlay(out_dir, tensors, params, cfg, complete=result.complete, base=base, fit=result.report)
