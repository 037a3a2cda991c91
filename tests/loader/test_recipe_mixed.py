"""``quant="UD-IQ3_XXS"`` on a GGUF + safetensors pair: routed experts from the GGUF as stored (QArray
banks of each tensor's own type), everything else from the original checkpoint; each source read
through its own name map (``zoo.sources.views.MixedSource``)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from gguf import quants as gq

import zoo
from tests.models.glm53 import reference as ref
from tests.support.gguf_files import write_gguf
from zoo.formats.ggml import QType
from zoo.quant.int8 import Int8Weight, quantize_int8
from zoo.quant.qarray import QArray
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource

# routed-expert bank -> ggml type written into the GGUF (rows of 64 / 32 weights: 32-blocks)
TYPES = {"gate": QType.Q8_0, "up": QType.Q4_0, "down": QType.Q5_1}
MTP_LAYER = 4                                    # config "A": 4 layers, the MTP layer stored as layers.4
SPARSE = (1, 2, 3, MTP_LAYER)


def expert_banks(hf: dict[str, np.ndarray], n_experts: int, skip: tuple[int, ...] = ()) -> dict:
    """GGUF tensors ``blk.L.ffn_{gate,up,down}_exps.weight`` [E, out, in], quantized by gguf, plus a
    router tensor that must *not* be taken from the GGUF."""
    out = {}
    for layer in SPARSE:
        if layer in skip:
            continue
        for p, qtype in TYPES.items():
            bank = np.stack([hf[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"] for e in range(n_experts)])
            out[f"blk.{layer}.ffn_{p}_exps.weight"] = (gq.quantize(bank.astype(np.float32), qtype), qtype)
    out["blk.1.ffn_gate_inp.weight"] = (np.full((n_experts, 64), 7.0, np.float32), QType.F32)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm-mixed")
    torch_model = ref.write_checkpoint(path, "A", seed=5, flat=True)
    hf = ref.read_all(path)
    n_experts = torch_model.config.text_config.n_routed_experts
    gguf = write_gguf(path / "UD-IQ3_XXS" / "tiny-UD-IQ3_XXS.gguf", "glm5-next", [], expert_banks(hf, n_experts))
    return path, gguf, hf, n_experts


def flat_params(module) -> dict:
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(module))}


@pytest.mark.parametrize("quant", ["UD-IQ3_XXS", "UD-IQ3_XXS-bf16"])
def test_experts_from_the_gguf_the_rest_from_the_checkpoint(pair, quant):
    """Both variants take the experts from the GGUF as stored; UD-IQ3_XXS keeps every other matmul
    weight as int8 (per output channel) from the checkpoint, UD-IQ3_XXS-bf16 keeps it dense."""
    path, gguf, _, n_experts = pair
    mixed = zoo.load(path, quant=quant, dtype="float32")
    plain = zoo.load(path, dtype="float32")
    ours, theirs = flat_params(mixed.module), flat_params(plain.module)
    assert ours.keys() == theirs.keys() and mixed.load_info["unused_tensors"] == []
    banks = {k: v for k, v in ours.items() if ".mlp.experts." in k}
    assert len(banks) == 3 * len(SPARSE)
    for key, bank in banks.items():
        layer = MTP_LAYER if key.startswith("mtp.") else int(key.split(".")[1])
        p = key.rsplit(".", 1)[1].removesuffix("_kernel")
        assert isinstance(bank, QArray) and bank.qtype == TYPES[p], key
        raw = GGUFSource(gguf).read(f"blk.{layer}.ffn_{p}_exps.weight")       # the GGUF's blocks, as stored
        assert np.array_equal(np.asarray(bank.blocks()), raw), key
        assert np.array_equal(np.asarray(bank.dequantize()), np.swapaxes(gq.dequantize(raw, TYPES[p]), -1, -2)), key
    rest = [k for k in ours if k not in banks]
    int8 = [k for k in rest if isinstance(ours[k], Int8Weight)]
    assert bool(int8) == (quant == "UD-IQ3_XXS") and all(k.endswith("kernel") for k in int8)
    for k in int8:                                  # the checkpoint's weight, quantized per output channel
        want = quantize_int8(theirs[k])
        assert np.array_equal(np.asarray(ours[k].q), np.asarray(want.q)), k
        assert np.array_equal(np.asarray(ours[k].scale), np.asarray(want.scale)), k
    assert all(np.array_equal(np.asarray(ours[k]), np.asarray(theirs[k])) for k in rest if k not in int8)
    assert not np.any(np.asarray(ours["layers.1.mlp.router.weight"]) == 7.0)     # the GGUF's router: not taken


def test_gguf_missing_or_incomplete(pair, tmp_path):
    path, _, hf, n_experts = pair
    with pytest.raises(ValueError, match="UD-IQ3_XXS.*load the checkpoint directory"):
        zoo.load(pair[1], quant="UD-IQ3_XXS")
    (tmp_path / "ckpt").mkdir()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "ckpt" / f).write_bytes((path / f).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"ckpt: no GGUF matching '\*UD-IQ3_XXS\*.gguf'"):
        zoo.load(tmp_path / "ckpt", quant="UD-IQ3_XXS")
    gguf = write_gguf(tmp_path / "ckpt" / "x-UD-IQ3_XXS.gguf", "glm5-next", [], expert_banks(hf, n_experts, skip=(3,)))
    with pytest.raises(SourceError, match=r"no tensor for parameter\(s\): layers.3.mlp.experts.down_kernel"):
        zoo.load(tmp_path / "ckpt", quant="UD-IQ3_XXS")
    router_only = {k: v for k, v in expert_banks(hf, n_experts).items() if "_exps" not in k}
    write_gguf(gguf, "glm5-next", [], router_only)
    with pytest.raises(SourceError, match=r"the GGUF .*x-UD-IQ3_XXS.gguf provides none of the parameters"):
        zoo.load(tmp_path / "ckpt", quant="UD-IQ3_XXS")
