"""Write *untrained* tiny demo models ``zoo/assets/{qwen38-tiny,glm53-tiny}/`` (deterministic). Needs
the dev extra (the GLM weights are drawn through transformers' model). The shipped assets are the
*trained* models of ``scripts/train_demo_models.py``, which calls this for its start weights (its
own tokenizer and chat template replace the ones written here); running this directly replaces the
shipped models with random ones.

    PYTHONPATH=. .venv/bin/python scripts/make_tiny_assets.py

Produces an HF-layout checkpoint: ``config.json`` (from ``zoo/configs/qwen38-tiny.json``),
``model.safetensors`` (bf16 random weights with a realistic spread, seeded, HF tensor names
incl. ``mtp.*``), ``tokenizer.json`` (a byte-level BPE trained on a small built-in text so the vocabulary
fits the model's 512 entries) and ``tokenizer_config.json`` with a ChatML template. The weights are
random: such a model shows the machinery (tokenizer, cache, sampling, server), not language.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "zoo" / "assets"
SEED = 20261130

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
GLM_SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
               "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>"]
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = """
The zoo runs large open models on hardware that should not be able to hold them. It loads
quantized weights from GGUF files, places every tensor directly on its devices, and serves an
OpenAI compatible endpoint with speculative decoding from the model's own prediction heads.
Hello, world! How are you today? I am a tiny model with random weights, so my answers are noise.
Tokens, caches, samplers and servers work all the same: one, two, three, four, five, six, seven.
def main(): print("hello") # code, numbers 0123456789, punctuation .,;:!?()[]{}<>=+-*/_'"
"""


def hf_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random HF-named tensors for a qwen3_5 text config (+ one MTP layer)."""
    d, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, conv_k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
    norm = lambda n: (0.1 * rng.standard_normal(n)).astype(np.float32)

    def attention(p):
        return {p + "self_attn.q_proj.weight": lin(nh * hd * 2, d), p + "self_attn.k_proj.weight": lin(nkv * hd, d),
                p + "self_attn.v_proj.weight": lin(nkv * hd, d), p + "self_attn.o_proj.weight": lin(d, nh * hd),
                p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}

    def common(p):
        return {p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                p + "mlp.gate_proj.weight": lin(inter, d), p + "mlp.up_proj.weight": lin(inter, d),
                p + "mlp.down_proj.weight": lin(d, inter)}

    conv_dim = 2 * nk * dk + nv * dv
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], d)).astype(np.float32),
         "model.norm.weight": norm(d), "lm_head.weight": lin(cfg["vocab_size"], d)}
    interval = cfg["full_attention_interval"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(common(p))
        if (i + 1) % interval == 0:
            t.update(attention(p))
            continue
        la = p + "linear_attn."
        t.update({la + "in_proj_qkv.weight": lin(conv_dim, d), la + "in_proj_z.weight": lin(nv * dv, d),
                  la + "in_proj_b.weight": lin(nv, d), la + "in_proj_a.weight": lin(nv, d),
                  la + "out_proj.weight": lin(d, nv * dv),
                  la + "conv1d.weight": (rng.standard_normal((conv_dim, 1, conv_k))
                                         / np.sqrt(conv_k)).astype(np.float32),
                  la + "A_log": np.log(rng.uniform(0.5, 8.0, nv)).astype(np.float32),
                  la + "dt_bias": (0.5 * rng.standard_normal(nv)).astype(np.float32),
                  la + "norm.weight": (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32)})
    t.update({"mtp.fc.weight": lin(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": norm(d),
              "mtp.pre_fc_norm_hidden.weight": norm(d), "mtp.norm.weight": norm(d)})
    t.update(common("mtp.layers.0."))
    t.update(attention("mtp.layers.0."))
    return t


def train_tokenizer(vocab_size: int, special: list[str] = SPECIAL) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def fresh(name: str) -> Path:
    out = ASSETS / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def write_tokenizer(out: Path, cfg: dict, special: list[str], eos: str, template: str) -> dict:
    """Train and save the tokenizer; returns ``cfg`` with its eos/pad ids."""
    tok = train_tokenizer(cfg["vocab_size"], special)
    assert tok.get_vocab_size() <= cfg["vocab_size"], tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": eos, "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": template},
        indent=2) + "\n")
    return {**cfg, "eos_token_id": tok.token_to_id(eos), "pad_token_id": tok.token_to_id("<|endoftext|>")}


def write_weights(out: Path, tensors: dict[str, np.ndarray]) -> None:
    bf16 = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(bf16, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)")


def make_qwen(overrides: dict | None = None) -> None:
    """``overrides``: config fields that replace ``zoo/configs/qwen38-tiny.json``'s (the demo model's own)."""
    out = fresh("qwen38-tiny")
    cfg = {**json.loads((ROOT / "zoo" / "configs" / "qwen38-tiny.json").read_text()), **(overrides or {})}
    cfg = write_tokenizer(out, cfg, SPECIAL, "<|im_end|>", CHAT_TEMPLATE)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_weights(out, hf_tensors(cfg, np.random.default_rng(SEED)))


def make_glm(overrides: dict | None = None) -> None:
    """GLM weights drawn through transformers' own model (realistic spread, the real key names),
    saved as a flat text-only checkpoint plus the MTP layer ``layers.{N}``; ``overrides`` as
    ``make_qwen``'s."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from tests.models.glm53 import reference as ref

    out = fresh("glm53-tiny")
    cfg = {**json.loads((ROOT / "zoo" / "configs" / "glm53-tiny.json").read_text()), **(overrides or {})}
    cfg = write_tokenizer(out, cfg, GLM_SPECIAL, "<|user|>", GLM_CHAT_TEMPLATE)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(SEED)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=ref.VISION))
    ref.redraw_(model, SEED)
    with tempfile.TemporaryDirectory() as tmp:      # on-disk key names, as save_pretrained writes them
        model.save_pretrained(tmp)
        tensors = {k.replace("model.language_model.", "model."): v
                   for k, v in ref.read_all(Path(tmp)).items() if "visual" not in k}
    tensors.update({k.replace("model.language_model.", "model."): v
                    for k, v in ref.mtp_tensors(model.config.text_config, SEED + 1, with_copies=False).items()})
    write_weights(out, tensors)


def main() -> None:
    make_qwen()
    make_glm()


if __name__ == "__main__":
    main()
