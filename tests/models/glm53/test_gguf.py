"""``zoo.load`` of ``glm5-next`` GGUF files: the llama.cpp fixture against its reference logits, a
mixed-type GGUF written here against the dense model of gguf-dequantized weights, the embedded MTP
block against a numpy MTP, the config read from the metadata, and errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq

import zoo
from tests.models.glm53 import reference as ref
from tests.support.gguf_files import dequantized, metadata_of, write_dense_copy, write_gguf
from tests.support.gguf_fixtures import GLM_FIXTURES
from tests.support.helpers import rel_err
from tests.support.paths import DATA
from zoo.formats.ggml import QType
from zoo.loader.gguf_model import config_from_gguf
from zoo.models.config import config_from_hf
from zoo.quant.qarray import QArray
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource

Q256 = DATA / "glm53-q256-udmix.gguf"
TINY_MTP = DATA / "glm53-tiny-mtp-f32.gguf"


@pytest.mark.parametrize("name", sorted(GLM_FIXTURES))
def test_config_from_the_gguf_metadata(name):
    src = GGUFSource(DATA / name)
    assert src.architecture == "glm5-next"
    ours = config_from_gguf(src)
    expected = config_from_hf({"model_type": "glm5_next_text", **GLM_FIXTURES[name]})
    fields = [f for f in GLM_FIXTURES[name] if f != "num_nextn_predict_layers"]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(expected, f) for f in fields}
    assert (ours.swiglu_limit, ours.hc_mult, ours.hc_eps, ours.rms_norm_eps) == (
        {"glm53-q256-udmix.gguf": 3.0, "glm53-tiny-mtp-f32.gguf": 1.5}[name], 4, 1e-6, 1e-5)
    assert ours.mtp_num_hidden_layers == GLM_FIXTURES[name].get("num_nextn_predict_layers", 0)


@pytest.fixture(scope="module")
def q256():
    model = zoo.load(Q256, dtype="float32")
    ids = np.load(DATA / "glm53-q256.input_ids.npy")
    return model, ids, model.logits(ids)


def test_fixture_logits_match_the_reference(q256):
    """Every position of both rows (no discrete choice flips against transformers)."""
    model, ids, ours = q256
    theirs = np.load(DATA / "glm53-q256-udmix.dequant_logits.npy")
    err = rel_err(ours, theirs)
    worst = np.abs(ours - theirs).max(-1) / np.abs(theirs).max()
    print(f"glm53-q256-udmix: max |zoo - transformers(dequantized)| / max |logit| = {err:.3e} "
          f"(worst position {np.unravel_index(worst.argmax(), worst.shape)})")
    assert ours.shape == theirs.shape == (2, 64, 512) and err <= 1e-4


def test_experts_are_qarray_banks_of_their_own_types(q256):
    model = q256[0]
    mlp = model.module.layers[1].mlp
    banks = {n: getattr(mlp.experts, f"{n}_kernel").get_value() for n in ("gate", "up", "down")}
    assert {n: (b.qtype, b.shape) for n, b in banks.items()} == {
        "gate": (QType.IQ2_S, (8, 256, 256)), "up": (QType.IQ2_S, (8, 256, 256)), "down": (QType.IQ3_S, (8, 256, 256))}
    attn = model.module.layers[1].self_attn
    assert attn.q_a_proj.kernel.get_value().qtype == QType.Q8_0
    assert not isinstance(attn.kv_b.get_value(), QArray) and attn.kv_b.get_value().shape == (4 * 128, 256)
    assert not isinstance(mlp.router.weight.get_value(), QArray)
    info = model.load_info
    assert info["unused_tensors"] == [] and model.tokenizer is not None and model.tokenizer.vocab_size == 512


def mixed_tensors(src: GGUFSource) -> dict:
    """The fixture re-stored as a mix: F32, BF16, gguf's Q8_0, llama.cpp's Q8_0 / Q6_K / IQ2_S / IQ3_S
    blocks (expert banks shuffled between experts and re-typed), and 4-D KDA convs."""
    rng = np.random.default_rng(7)
    iq3_s = src.read("blk.3.ffn_down_exps.weight")                       # [8, 256, 110]: rows of 256 weights
    out = {}
    for key in src.keys():
        info, data = src.info(key), src.read(key)
        if key in ("blk.1.attn_q_a.weight", "blk.3.attn_v.weight"):
            out[key] = (dequantized(src, key), QType.F32)
        elif key in ("blk.1.attn_q_b.weight", "blk.2.attn_k_b.weight", "blk.3.ssm_f_a.weight",
                     "blk.0.attn_norm.weight"):
            out[key] = (dequantized(src, key), QType.BF16)
        elif key in ("blk.1.attn_kv_a_mqa.weight", "blk.2.indexer.attn_q_b.weight", "blk.1.ffn_gate_inp.weight"):
            out[key] = (data, QType.Q8_0)                                # F32 -> gguf's quantizer
        elif key == "blk.1.ffn_gate_exps.weight":
            out[key] = (data[rng.permutation(8)], info.qtype)
        elif key == "blk.2.ffn_up_exps.weight":
            out[key] = (iq3_s[rng.permutation(8)], QType.IQ3_S)          # IQ2_S bank -> real IQ3_S blocks
        elif key.startswith("blk.0.ssm_conv1d_"):
            out[key] = (data.reshape(1, -1, 1, data.shape[-1]), info.qtype)   # ne [K, 1, C, 1]
        else:
            out[key] = (data, info.qtype)
    return out


def test_written_mixed_gguf_equals_the_dense_model(tmp_path):
    meta = metadata_of(Q256)
    mixed = write_gguf(tmp_path / "mixed.gguf", "glm5-next", meta, mixed_tensors(GGUFSource(Q256)))
    src = GGUFSource(mixed)
    assert {src.info(k).qtype.name for k in src.keys()} == {"F32", "BF16", "Q8_0", "Q6_K", "IQ2_S", "IQ3_S"}
    dense = write_dense_copy(src, tmp_path / "dense.gguf", meta)
    ids = np.load(DATA / "glm53-q256.input_ids.npy")[:, :24]
    model = zoo.load(mixed, dtype="float32")
    assert model.module.layers[2].mlp.experts.up_kernel.get_value().qtype == QType.IQ3_S
    ours, theirs = model.logits(ids), zoo.load(dense, dtype="float32").logits(ids)
    err = rel_err(ours, theirs)
    print(f"mixed-type GLM GGUF vs dense gguf-dequantized model: {err:.3e}")
    assert np.std(theirs) > 0.1 and err <= 1e-5


def hf_mtp_tensors(src: GGUFSource, cfg) -> dict[str, np.ndarray]:
    """The MTP block ``blk.{N}.*`` under the on-disk HF names ``glm_reference.numpy_mtp_logits`` reads."""
    g = lambda k: src.read(f"blk.{cfg.num_hidden_layers}.{k}").astype(np.float32)   # noqa: E731
    k_b, v_b = g("attn_k_b.weight"), g("attn_v_b.weight")                 # [H, C, dn], [H, dv, C]
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
    t = {"eh_proj.weight": g("nextn.eh_proj.weight"), "enorm.weight": g("nextn.enorm.weight"),
         "hnorm.weight": g("nextn.hnorm.weight"), "shared_head.norm.weight": g("nextn.shared_head_norm.weight"),
         "input_layernorm.weight": g("attn_norm.weight"), "post_attention_layernorm.weight": g("ffn_norm.weight"),
         "self_attn.q_a_proj.weight": g("attn_q_a.weight"), "self_attn.q_a_layernorm.weight": g("attn_q_a_norm.weight"),
         "self_attn.q_b_proj.weight": g("attn_q_b.weight"),
         "self_attn.kv_a_proj_with_mqa.weight": g("attn_kv_a_mqa.weight"),
         "self_attn.kv_a_layernorm.weight": g("attn_kv_a_norm.weight"), "self_attn.kv_b_proj.weight": kv_b,
         "self_attn.o_proj.weight": g("attn_output.weight"),
         "self_attn.indexer.wq_b.weight": g("indexer.attn_q_b.weight"),
         "self_attn.indexer.wk.weight": g("indexer.attn_k.weight"),
         "self_attn.indexer.k_norm.weight": g("indexer.k_norm.weight"),
         "self_attn.indexer.k_norm.bias": g("indexer.k_norm.bias"),
         "self_attn.indexer.weights_proj.weight": g("indexer.proj.weight"),
         "self_attn.indexer.index_kpool_compress_gate": g("indexer_compressor_gate.weight"),
         "self_attn.indexer.index_kpool_compress_ape": g("indexer_compressor_ape.weight"),
         "mlp.gate.weight": g("ffn_gate_inp.weight"), "mlp.gate.e_score_correction_bias": g("exp_probs_b.bias"),
         **{f"mlp.shared_experts.{p}_proj.weight": g(f"ffn_{p}_shexp.weight") for p in ("gate", "up", "down")}}
    for p in ("gate", "up", "down"):
        bank = g(f"ffn_{p}_exps.weight")
        t.update({f"mlp.experts.{e}.{p}_proj.weight": bank[e] for e in range(len(bank))})
    return {f"model.language_model.layers.{cfg.num_hidden_layers}.{k}": v for k, v in t.items()}


def test_mtp_block_matches_the_numpy_reference():
    """The tiny llama.cpp file with an embedded MTP block (blk.8 + blk.8.nextn.*, 4-D KDA convs)."""
    model = zoo.load(TINY_MTP, dtype="float32")
    cfg, src = model.config, GGUFSource(TINY_MTP)
    assert (cfg.num_hidden_layers, cfg.mtp_num_hidden_layers, cfg.hidden_size) == (8, 1, 64)
    ids = np.random.default_rng(2).integers(0, 512, (2, 32))             # 31 rows: up to 7 pools, 4 kept
    embed, head = (src.read(k).astype(np.float32) for k in ("token_embd.weight", "output.weight"))
    theirs, margins = ref.numpy_mtp_logits(ids, model.hidden_states(ids), embed, head, hf_mtp_tensors(src, cfg), cfg)
    err = rel_err(model.mtp_logits(ids), theirs)
    print(f"MTP logits (tiny GLM MTP GGUF) vs numpy reference: {err:.3e}, margins {margins}")
    assert min(margins.values()) > 1e-5 and err <= 1e-4


def test_quantized_k_b_and_missing_v_b(tmp_path):
    """kv_b is joined from dequantized parts (a Q8_0 attn_v_b); a missing part is named."""
    src = GGUFSource(TINY_MTP)
    tensors = {k: (src.read(k), QType.F32) for k in src.keys()}
    k_b, v_b = tensors["blk.3.attn_k_b.weight"][0], tensors["blk.3.attn_v_b.weight"][0]   # [H, C, dn], [H, dv, C]
    tensors["blk.3.attn_v_b.weight"] = (v_b, QType.Q8_0)
    model = zoo.load(write_gguf(tmp_path / "q8vb.gguf", "glm5-next", metadata_of(TINY_MTP), tensors), dtype="float32")
    kv_b = np.asarray(model.module.layers[3].self_attn.kv_b.get_value()).reshape(4, 32, 32)   # [H, dn+dv, C]
    v_deq = gq.dequantize(gq.quantize(v_b, QType.Q8_0), QType.Q8_0)
    assert np.array_equal(kv_b[:, :16], k_b.transpose(0, 2, 1))
    assert np.array_equal(kv_b[:, 16:], v_deq)
    del tensors["blk.7.attn_v_b.weight"]
    bad = write_gguf(tmp_path / "nov.gguf", "glm5-next", metadata_of(TINY_MTP), tensors)
    with pytest.raises(SourceError, match=r"nov.gguf: tensor 'blk.7.attn_k_b.weight' needs 'blk.7.attn_v_b.weight'"):
        zoo.load(bad)
