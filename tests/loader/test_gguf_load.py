"""``zoo.load`` of ``qwen35`` GGUF files: the llama.cpp fixtures against their reference logits,
GGUFs written here (every storage type, split sets) against the dense model of gguf-dequantized
weights, the MTP block, recipes, the embedded tokenizer, and load errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import quants as gq

import zoo
from tests.models.qwen38 import reference as ref
from tests.support.gguf_files import dequantized, metadata_of, write_dense_copy, write_gguf
from tests.support.helpers import rel_err
from tests.support.paths import DATA
from zoo.formats.ggml import QType
from zoo.quant.qarray import QArray
from zoo.registry import embedded_path
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource

Q256 = DATA / "qwen38-q256-udmix.gguf"
TINY_MTP = DATA / "qwen38-tiny-mtp-f32.gguf"
GLM = DATA / "glm53-q256-udmix.gguf"


@pytest.fixture(scope="module")
def q256():
    model = zoo.load(Q256, dtype="float32")
    ids = np.load(DATA / "qwen38-q256.input_ids.npy")
    return model, ids, model.logits(ids)


def test_fixture_logits_match_the_reference(q256):
    model, ids, ours = q256
    theirs = np.load(DATA / "qwen38-q256-udmix.dequant_logits.npy")
    err = rel_err(ours, theirs)
    print(f"qwen38-q256-udmix: max |zoo - transformers(dequantized)| / max |logit| = {err:.3e}")
    assert ours.shape == theirs.shape and err <= 1e-4


def test_storage_follows_each_tensors_own_type(q256):
    model = q256[0]
    layer = model.module.layers[0]
    kinds = {name: w.get_value() for name, w in [
        ("gate", layer.mlp.gate_proj.kernel), ("down", layer.mlp.down_proj.kernel),
        ("qkv", layer.linear_attn.in_proj_qkv.kernel), ("out", layer.linear_attn.out_proj.kernel),
        ("head", model.module.lm_head.kernel)]}
    assert {k: v.qtype for k, v in kinds.items()} == {
        "gate": QType.IQ3_XXS, "down": QType.IQ4_XS, "qkv": QType.Q8_0, "out": QType.Q8_0, "head": QType.Q6_K}
    assert kinds["gate"].shape == (256, 512) and kinds["out"].in_order is not None
    assert not isinstance(model.module.embed_tokens.embedding.get_value(), QArray)   # gathered by row: dense
    assert model.config.num_hidden_layers == 4 and model.config.linear_num_value_heads == 12
    info = model.load_info
    assert (info["source"], info["format"], info["dtype"]) == ("source", "gguf", "float32")
    assert info["unused_tensors"] == []
    assert model.tokenizer is not None and model.tokenizer.vocab_size == 512


def test_qarray_model_equals_the_dense_model_of_dequantized_weights(q256, tmp_path):
    model, ids, ours = q256
    src = GGUFSource(Q256)
    dense = zoo.load(write_dense_copy(src, tmp_path / "dense.gguf", metadata_of(Q256)), dtype="float32")
    err = rel_err(ours, dense.logits(ids))
    print(f"QArray model vs dense model of gguf-dequantized weights: {err:.3e}")
    assert err <= 1e-5


def mixed_tensors(src: GGUFSource) -> dict:
    """The fixture's tensors re-stored as a mix of F32, BF16, Q8_0 (gguf's quantizer), llama.cpp's
    Q8_0 / Q6_K / IQ3_XXS / IQ4_XS blocks, and IQ2_S / IQ3_S blocks borrowed from the GLM fixture."""
    rng = np.random.default_rng(5)
    glm = GGUFSource(GLM)
    iq2_s = glm.read("blk.1.ffn_gate_exps.weight").reshape(-1, 82)        # rows of 256 weights
    iq3_s = glm.read("blk.1.ffn_down_exps.weight").reshape(-1, 110)
    q6_k = src.read("output.weight").reshape(-1, 210)
    out = {}
    for key in src.keys():
        info, layer = src.info(key), key.split(".")[1] if key.startswith("blk.") else None
        data = src.read(key)
        if info.qtype == QType.Q8_0 and layer in ("0", "1", "2"):
            out[key] = (dequantized(src, key), {"0": QType.F32, "1": QType.Q8_0, "2": QType.BF16}[layer])
        elif key == "blk.1.ffn_gate.weight":
            out[key] = (iq2_s[rng.permutation(len(iq2_s))[:512]], QType.IQ2_S)
        elif key == "blk.2.ffn_up.weight":
            out[key] = (iq3_s[rng.permutation(len(iq3_s))[:512]], QType.IQ3_S)
        elif key == "blk.1.ffn_down.weight":
            out[key] = (q6_k[rng.permutation(len(q6_k))].reshape(256, 420), QType.Q6_K)
        elif key == "blk.3.ffn_up.weight":
            out[key] = (data[rng.permutation(len(data))], info.qtype)     # shuffled IQ3_XXS rows
        elif key in ("blk.1.attn_norm.weight", "blk.2.ssm_conv1d.weight"):
            out[key] = (data, QType.BF16)
        else:
            out[key] = (data, info.qtype)
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A written mixed-type GGUF, its split copy, and the dense F32 copy of gguf-dequantized values."""
    tmp = tmp_path_factory.mktemp("mixed")
    meta = metadata_of(Q256)
    tensors = mixed_tensors(GGUFSource(Q256))
    single = write_gguf(tmp / "mixed.gguf", "qwen35", meta, tensors)
    split = write_gguf(tmp / "split" / "mixed.gguf", "qwen35", meta, tensors, split_max_tensors=16)
    dense = write_dense_copy(GGUFSource(single), tmp / "dense.gguf", meta)
    return single, split, dense


def test_written_mixed_gguf_equals_the_dense_model(mixed):
    single, _, dense = mixed
    types = {GGUFSource(single).info(k).qtype.name for k in GGUFSource(single).keys()}
    assert types == {"F32", "BF16", "Q8_0", "Q6_K", "IQ2_S", "IQ3_S", "IQ3_XXS", "IQ4_XS"}
    ids = np.random.default_rng(0).integers(0, 512, (2, 24))
    ours, theirs = zoo.load(single, dtype="float32").logits(ids), zoo.load(dense, dtype="float32").logits(ids)
    err = rel_err(ours, theirs)
    print(f"mixed-type GGUF vs dense gguf-dequantized model: {err:.3e}")
    assert np.std(theirs) > 0.1 and err <= 1e-5


def test_split_gguf_loads_the_same_as_the_single_file(mixed):
    """Same parameters, bit for bit (so the same logits)."""
    single, split, _ = mixed
    assert split.name == "mixed-00001-of-00004.gguf"
    a, b = (jax.tree_util.tree_leaves(nnx.state(zoo.load(p, dtype="float32").module)) for p in (single, split))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_mtp_block_matches_the_numpy_reference():
    """The tiny llama.cpp file with an embedded MTP block (blk.8 + blk.8.nextn.*)."""
    model = zoo.load(TINY_MTP, dtype="float32")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.mtp_num_hidden_layers, cfg.hidden_size) == (8, 1, 64)
    assert cfg.layer_types.count("full_attention") == 2 and cfg.linear_num_value_heads == 6
    src = GGUFSource(TINY_MTP)
    g = lambda k: src.read(k).astype(np.float32)            # noqa: E731
    n, p = "blk.8.", "mtp.layers.0."
    mtp = {"mtp.fc.weight": g(n + "nextn.eh_proj.weight"),
           "mtp.pre_fc_norm_embedding.weight": g(n + "nextn.enorm.weight") - 1,
           "mtp.pre_fc_norm_hidden.weight": g(n + "nextn.hnorm.weight") - 1,
           "mtp.norm.weight": g(n + "nextn.shared_head_norm.weight") - 1,
           p + "input_layernorm.weight": g(n + "attn_norm.weight") - 1,
           p + "post_attention_layernorm.weight": g(n + "post_attention_norm.weight") - 1,
           p + "self_attn.q_norm.weight": g(n + "attn_q_norm.weight") - 1,
           p + "self_attn.k_norm.weight": g(n + "attn_k_norm.weight") - 1,
           **{p + f"self_attn.{x}_proj.weight": g(n + f"attn_{y}.weight")
              for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))},
           **{p + f"mlp.{x}_proj.weight": g(n + f"ffn_{x}.weight") for x in ("gate", "up", "down")}}
    rope = {"rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    hf_cfg = SimpleNamespace(rms_norm_eps=cfg.rms_norm_eps, head_dim=cfg.head_dim, rope_parameters=rope,
                             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads)
    ids = np.random.default_rng(2).integers(0, 512, (2, 20))
    hidden = model.hidden_states(ids)
    theirs = ref.numpy_mtp_logits(ids, hidden, g("token_embd.weight"), g("output.weight"), mtp, hf_cfg)
    err = rel_err(model.mtp_logits(ids), theirs)
    print(f"MTP logits (tiny MTP GGUF) vs numpy reference: {err:.3e}")
    assert err <= 1e-4


def params(model) -> dict[str, np.ndarray]:
    """Every parameter of a loaded model as a dense float32 array (QArrays dequantized)."""
    flat = nnx.to_flat_state(nnx.state(model.module))
    return {".".join(map(str, path)): np.asarray(v.get_value().dequantize() if isinstance(v.get_value(), QArray)
                                                 else v.get_value(), np.float32) for path, v in flat}


def test_q8_0_recipe_equals_gguf_q8_0_round_trip(tmp_path):
    """quant='Q8_0' stores every float matmul weight as gguf's Q8_0 blocks (dequantized: exactly the
    round trip through gguf's quantizer and dequantizer); the rest stays as it was."""
    src = GGUFSource(TINY_MTP)
    keep = ("token_embd.weight",)                   # gathered by row, not a matmul: stays dense
    tensors = {k: (gq.dequantize(gq.quantize(src.read(k), QType.Q8_0), QType.Q8_0)
                   if src.read(k).ndim == 2 and k not in keep and not k.endswith("ssm_conv1d.weight")
                   else src.read(k), QType.F32) for k in src.keys()}
    oracle = zoo.load(write_gguf(tmp_path / "q8.gguf", "qwen35", metadata_of(TINY_MTP), tensors), dtype="float32")
    model = zoo.load(TINY_MTP, dtype="float32", quant="Q8_0")
    stored = model.module.layers[0].linear_attn.out_proj.kernel.get_value()
    assert isinstance(stored, QArray) and stored.qtype == QType.Q8_0 and stored.in_order is not None
    ours, theirs = params(model), params(oracle)
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_bf16_recipe_stores_everything_dense():
    model = zoo.load(Q256, quant="bf16")
    src = GGUFSource(Q256)
    leaves = jax.tree_util.tree_leaves(nnx.state(model.module))
    assert all(isinstance(x, jax.Array) and x.dtype in (jnp.bfloat16, jnp.float32) for x in leaves)
    gate = model.module.layers[0].mlp.gate_proj.kernel.get_value()
    assert gate.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(gate), dequantized(src, "blk.0.ffn_gate.weight").T.astype(jnp.bfloat16))


def test_recipe_errors():
    with pytest.raises(ValueError, match="unknown quantization recipe 'Q9'; known: .*Q8_0.*UD-IQ3_XXS.*bf16"):
        zoo.load(TINY_MTP, quant="Q9")
    with pytest.raises(ValueError, match="UD-IQ3_XXS.*from a GGUF and the rest from the original checkpoint"):
        zoo.load(DATA / "glm53-tiny-mtp-f32.gguf", quant="UD-IQ3_XXS")     # GLM's recipe mixes two sources
    with pytest.raises(ValueError, match="UD-IQ3_XXS.*loads the GGUF matching .* quant=None"):
        zoo.load(TINY_MTP, quant="UD-IQ3_XXS")                            # Qwen's is a whole GGUF
    with pytest.raises(ValueError, match="stores weights as bfloat16"):
        zoo.load(TINY_MTP, quant="bf16", dtype="float32")


# --- errors -------------------------------------------------------------------------------------


def test_shape_mismatch_and_missing_tensor_name_file_and_tensor(tmp_path):
    src = GGUFSource(TINY_MTP)
    tensors = {k: (src.read(k), QType.F32) for k in src.keys()}
    tensors["blk.0.attn_norm.weight"] = (np.ones(63, np.float32), QType.F32)
    bad = write_gguf(tmp_path / "shape.gguf", "qwen35", metadata_of(TINY_MTP), tensors)
    with pytest.raises(SourceError, match=r"shape.gguf: tensor 'blk.0.attn_norm.weight' has shape \(63,\); "
                                          r"parameter layers.0.input_layernorm.weight needs \(64,\)"):
        zoo.load(bad)
    del tensors["blk.0.attn_norm.weight"]
    missing = write_gguf(tmp_path / "missing.gguf", "qwen35", metadata_of(TINY_MTP), tensors)
    with pytest.raises(SourceError, match="no tensor for parameter.*layers.0.input_layernorm.weight"):
        zoo.load(missing)


def test_unsupported_architecture_and_missing_metadata(tmp_path):
    glm_like = write_gguf(tmp_path / "arch.gguf", "mamba9", [], {"x": (np.ones(4, np.float32), QType.F32)})
    with pytest.raises(SourceError, match="arch.gguf: GGUF architecture 'mamba9' is not supported"):
        zoo.load(glm_like)
    meta = [m for m in metadata_of(TINY_MTP) if m[0] != "qwen35.ssm.group_count"]
    src = GGUFSource(TINY_MTP)
    no_key = write_gguf(tmp_path / "nokey.gguf", "qwen35", meta, {k: (src.read(k), QType.F32) for k in src.keys()})
    with pytest.raises(SourceError, match="nokey.gguf: GGUF metadata has no 'qwen35.ssm.group_count'"):
        zoo.load(no_key)
    from gguf import GGUFValueType as T
    meta = [m if m[0] != "qwen35.block_count" else (m[0], "nine", T.STRING, None) for m in metadata_of(TINY_MTP)]
    wrong = write_gguf(tmp_path / "wrong.gguf", "qwen35", meta, {k: (src.read(k), QType.F32) for k in src.keys()})
    with pytest.raises(SourceError, match="wrong.gguf: GGUF metadata does not describe a qwen35 model"):
        zoo.load(wrong)


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_from_the_embedded_vocabulary():
    from zoo.text.gguf_vocab import tokenizer_from_gguf

    tok = tokenizer_from_gguf(GGUFSource(TINY_MTP))
    assert tok is not None and tok.vocab_size == 512 and tok.eos_token == "<|endoftext|>"
    text = "def self.for(x):\n    return x  # café"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<|endoftext|>b")[1] == 511              # special tokens are never split


def test_tokenizer_matches_the_hf_tokenizer_it_was_made_from(tmp_path):
    """A byte-level BPE vocabulary (the embedded demo model's tokenizer.json, whose pre-tokenizer is
    Qwen2's: digits one by one) written into a GGUF the way llama.cpp's converter does encodes
    exactly as the HF tokenizer."""
    from gguf import GGUFValueType as T
    from tokenizers import Tokenizer as HFTokenizer

    from zoo.text.gguf_vocab import tokenizer_from_gguf

    asset = Path(zoo.__file__).parent / "assets" / "qwen38-tiny" / "tokenizer.json"
    hf = HFTokenizer.from_file(str(asset))
    spec = json.loads(asset.read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in spec["added_tokens"]}
    meta = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "qwen2", T.STRING, None),
            ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
            ("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens], T.ARRAY, T.INT32),
            ("tokenizer.ggml.merges", [" ".join(m) for m in spec["model"]["merges"]], T.ARRAY, T.STRING)]
    path = write_gguf(tmp_path / "tok.gguf", "qwen35", meta, {"x": (np.ones(4, np.float32), QType.F32)})
    ours = tokenizer_from_gguf(GGUFSource(path))
    for text in ["Hello world, it's 2026!", "  leading spaces\n\nand\ttabs", "<|im_start|>user\nhi<|im_end|>",
                 "What is 12345 + 678?"]:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def test_qwen_ud_recipe_is_the_whole_gguf_of_the_checkpoint_directory(tmp_path):
    """``quant="UD-IQ3_XXS"`` on a Qwen3.8 checkpoint directory loads the GGUF matching
    ``*UD-IQ3_XXS*.gguf`` in it, every tensor as stored: the same model as loading that file."""
    ckpt = tmp_path / "qwen-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((embedded_path("qwen38-tiny") / "config.json").read_text())
    gguf = ckpt / "Qwen3.8-UD-IQ3_XXS.gguf"
    gguf.write_bytes((DATA / "qwen38-q256-udmix.gguf").read_bytes())
    ud = zoo.load(ckpt, quant="UD-IQ3_XXS", dtype="float32")
    direct = zoo.load(gguf, dtype="float32")
    assert ud.load_info["format"] == "gguf" and ud.config == direct.config
    ids = np.load(DATA / "qwen38-q256.input_ids.npy")[:, :24]
    assert np.array_equal(ud.logits(ids), direct.logits(ids))
    assert any(isinstance(x, QArray) for x in jax.tree_util.tree_leaves(
        nnx.state(ud.module), is_leaf=lambda x: isinstance(x, QArray)))
    (ckpt / gguf.name).unlink()
    with pytest.raises(FileNotFoundError, match=r"no GGUF matching '\*UD-IQ3_XXS\*.gguf'"):
        zoo.load(ckpt, quant="UD-IQ3_XXS")
