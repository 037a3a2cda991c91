"""The memory planner: inventories checked against real GGUF files, the UD-IQ3_XXS expert bytes of
GLM-5.3-Flash (docs/reference.md section 3), and the Plan API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zoo
from tests.support.gguf_fixtures import GLM_FIXTURES, ROUTED_EXPERT_BYTES
from tests.support.paths import DATA
from zoo import registry
from zoo.loader.gguf_model import config_from_gguf
from zoo.models.architectures import architecture
from zoo.models.config import config_from_hf
from zoo.sources.gguf import GGUFSource
from zoo.tools.plan import plan_config, plan_gguf

# GLM-5.3-Flash as docs/reference.md section 1 describes it (transformers' glm5_next defaults), with
# its MTP layer; zoo.plan("glm53-flash") reads the same from zoo/configs/glm53-flash.json once it exists.
GLM53_FLASH = {"model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096,
               "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 45,
               "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "n_routed_experts": 288,
               "num_experts_per_tok": 8, "n_shared_experts": 1, "num_nextn_predict_layers": 1}


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    src = GGUFSource(path)
    return {k: src.info(k).shape for k in src.keys()}


@pytest.mark.parametrize("name", ["qwen38-q256-udmix.gguf", "qwen38-tiny-mtp-f32.gguf"])
def test_qwen_inventory_is_exactly_the_files_tensors(name):
    cfg = config_from_gguf(GGUFSource(DATA / name))
    assert {t.name: t.shape for t in architecture("qwen38").part("inventory")(cfg)} == shapes(DATA / name)


@pytest.mark.parametrize("name", sorted(GLM_FIXTURES))
def test_glm_inventory_is_exactly_the_files_tensors(name):
    """Up to unit dims: llama.cpp writes the KDA convs as ne [4, 1, C] or [4, 1, C, 1] by version."""
    cfg = config_from_hf({"model_type": "glm5_next_text", **GLM_FIXTURES[name]})
    squeeze = lambda table: {k: tuple(d for d in v if d != 1) for k, v in table.items()}   # noqa: E731
    inventory = architecture("glm53").part("inventory")(cfg)
    assert squeeze({t.name: t.shape for t in inventory}) == squeeze(shapes(DATA / name))


def glm53_plan(quant: str, devices: int = 8):
    if "glm53-flash" in registry.REGISTRY and registry.preset_path("glm53-flash.json").is_file():
        return zoo.plan("glm53-flash", quant=quant, devices=devices)
    return plan_config(config_from_hf(GLM53_FLASH), quant, devices, "glm53-flash")


def test_glm53_ud_iq3_xxs_routed_experts_bytes():
    plan = glm53_plan("UD-IQ3_XXS")
    assert plan.by_class["routed_experts"] == ROUTED_EXPERT_BYTES
    kinds = {t.tensor.name: t.kind for t in plan.tensors if t.tensor.cls == "routed_experts"}
    assert (kinds["blk.11.ffn_up_exps.weight"], kinds["blk.11.ffn_down_exps.weight"]) == ("IQ3_S", "IQ4_XS")
    assert (kinds["blk.44.ffn_gate_exps.weight"], kinds["blk.44.ffn_down_exps.weight"]) == ("IQ2_S", "IQ4_XS")
    assert (kinds["blk.3.ffn_gate_exps.weight"], kinds["blk.30.ffn_down_exps.weight"]) == ("IQ2_S", "IQ3_S")
    assert min(int(k.split(".")[1]) for k in kinds) == 3 and max(int(k.split(".")[1]) for k in kinds) == 44
    mtp_experts = sum(t.nbytes for t in plan.tensors if t.tensor.cls == "mtp" and "_exps" in t.tensor.name)
    assert round(mtp_experts / 1e9, 2) == 2.62                           # Q2_K / Q2_K / Q3_K
    per_chip = sum(t.per_device_bytes for t in plan.tensors if t.tensor.cls == "routed_experts")
    print(f"UD-IQ3_XXS routed experts: {plan.by_class['routed_experts']:,} B; planes per chip "
          f"{per_chip:,} B; total {plan.total_bytes:,} B, {plan.per_device_bytes:,} B per chip")
    assert 13.8e9 < per_chip < 13.9e9                                   # docs/reference.md section 4: ~13.84 GB
    assert plan.total_bytes == sum(plan.by_class.values()) and plan.per_device_bytes < plan.total_bytes / 7
    # per chip, what the loader holds: the non-expert matmul weights as int8, the small replicated
    # matrices split along their input (14.38 GiB); the -bf16 variant reads them from FP8 into bf16
    def text_part(p):
        return p.per_device_bytes - sum(t.per_device_bytes for t in p.tensors if t.tensor.cls == "vision")

    assert 14.35 * 2**30 < text_part(plan) < 14.4 * 2**30
    assert 15.3 * 2**30 < text_part(glm53_plan("UD-IQ3_XXS-bf16")) < 15.35 * 2**30
    # the vision tower: 0.58 GB stored, its matmuls int8 like the other non-expert ones, 75 MB per chip
    tower = [t for t in plan.tensors if t.tensor.cls == "vision"]
    assert 0.55e9 < sum(t.nbytes for t in tower) < 0.6e9 and {t.kind for t in tower} == {"INT8", "BF16"}
    assert 70e6 < sum(t.per_device_bytes for t in tower) < 80e6
    assert plan.fits(15.6e9) and not plan.fits(15.5e9) and not plan.fits(per_chip)


def test_device_count_and_recipes():
    one, eight = glm53_plan("bf16", 1), glm53_plan("bf16", 8)
    assert one.total_bytes == eight.total_bytes
    # one device holds every weight as loaded: bf16, and the few float32 parameters (decays, mHC) at 4 bytes
    assert one.total_bytes < one.per_device_bytes < 1.001 * one.total_bytes
    assert eight.per_device_bytes < one.per_device_bytes / 7
    assert set(one.by_kind) == {"BF16"}
    q8 = glm53_plan("Q8_0")
    q8_tensors = {t.tensor.name for t in q8.tensors if t.kind == "Q8_0"}
    bf16_of_those = sum(t.nbytes for t in one.tensors if t.tensor.name in q8_tensors)
    assert q8.by_kind["Q8_0"] * 64 == bf16_of_those * 34          # 34 bytes per 32 weights
    assert q8.total_bytes < 0.6 * one.total_bytes


def test_zoo_plan_of_a_registry_model():
    plan = zoo.plan("qwen38-27b", quant="bf16", devices=8)
    params = sum(t.nbytes for t in plan.tensors) // 2
    assert 27.0e9 < params < 27.8e9 and plan.model == "qwen38-27b" and plan.devices == 8
    assert {"attention", "mlp", "embedding", "output", "mtp"} <= set(plan.by_class)
    assert "qwen38-27b / bf16 on 8 device(s)" in plan.summary()
    with pytest.raises(ValueError, match="unknown quantization recipe 'Q1'; known: .*UD-IQ3_XXS"):
        zoo.plan("qwen38-27b", quant="Q1")
    with pytest.raises(ValueError, match="devices must be >= 1"):
        zoo.plan("qwen38-27b", quant="bf16", devices=0)


@pytest.mark.parametrize("name", ["glm53-q256-udmix.gguf", "qwen38-q256-udmix.gguf"])
def test_plan_of_a_gguf_header_is_its_tensors_as_stored(name):
    src = GGUFSource(DATA / name)
    plan = plan_gguf(DATA / name, devices=2)
    assert plan.recipe == "as stored" and "other" not in plan.by_class
    assert {t.tensor.name: (t.kind, t.nbytes) for t in plan.tensors} == {
        k: (src.info(k).qtype.name, src.info(k).nbytes) for k in src.keys()}
    assert plan.per_device_bytes < plan.total_bytes
    assert plan_gguf(DATA / name, devices=2, quant="bf16").by_kind.keys() == {"BF16"}


def test_plan_cli(capsys):
    from zoo.cli import main

    args = ["plan", "glm53-flash", "--quant", "UD-IQ3_XXS", "--devices", "8"]
    assert main(args + ["--json", "--budget-gb", "17.0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["by_class"]["routed_experts"] == ROUTED_EXPERT_BYTES and doc["fits"] is True
    assert main(args + ["--budget-gb", "13"]) == 1
    assert "fits 13 GB per device: no" in capsys.readouterr().out
    assert main(args + ["--layout", "ep", "--budget-gb", "16.5"]) == 1       # 16.58 GB per chip in 2x4 ep
    assert "fits 16.5 GB per device: no" in capsys.readouterr().out
    assert main(["plan", str(DATA / "glm53-q256-udmix.gguf"), "--devices", "2"]) == 0
    assert "glm53-q256-udmix.gguf / as stored on 2 device(s)" in capsys.readouterr().out
    assert main(["plan", "glm53-flash"]) == 2
    assert "--quant RECIPE is required" in capsys.readouterr().err
    assert main(args + ["--prefix-cache", "--json"]) == 0
    prefix = json.loads(capsys.readouterr().out)["prefix_cache"]
    # GLM-5.3-Flash on 8 chips: the MLA latents split over the sequence; snapshots are the KDA states
    assert 1000 < prefix["per_token"] < 4000 and 10 * 2**20 < prefix["snapshot"] < 40 * 2**20, prefix
    assert main(["plan", "qwen38-27b", "--quant", "int8", "--prefix-cache"]) == 0
    assert "prefix cache entries of qwen38-27b per chip" in capsys.readouterr().out


def test_recipes_are_per_model():
    """UD-IQ3_XXS means GLM's mixed recipe for GLM; for Qwen3.8 it is the whole Unsloth GGUF, whose
    per-tensor types only the file knows: planning it without the file is a clear error."""
    glm = zoo.plan("glm53-flash", quant="UD-IQ3_XXS", devices=8)
    assert glm.by_kind.keys() >= {"IQ2_S", "IQ3_S", "IQ4_XS", "INT8"} and "FP8" not in glm.by_kind
    assert "FP8" in zoo.plan("glm53-flash", quant="UD-IQ3_XXS-bf16", devices=8).by_kind
    with pytest.raises(ValueError, match="UD-IQ3_XXS.*qwen38 is a whole GGUF.*zoo plan FILE.gguf"):
        zoo.plan("qwen38-27b", quant="UD-IQ3_XXS")


def test_int8_recipe_plans_a_byte_per_weight_and_a_scale_per_output_channel():
    plan = zoo.plan("qwen38-27b", quant="int8", devices=8)
    kinds = {t.tensor.name: (t.kind, t.nbytes, t.tensor.shape) for t in plan.tensors}
    kind, nbytes, (rows, cols) = kinds["blk.0.ffn_gate.weight"]
    assert kind == "INT8" and nbytes == rows * (cols + 4)
    assert kinds["token_embd.weight"][0] == "BF16" and kinds["blk.0.attn_norm.weight"][0] == "BF16"
    bf16 = zoo.plan("qwen38-27b", quant="bf16", devices=8)
    assert 0.5 < plan.total_bytes / bf16.total_bytes < 0.56      # ~1 of 2 bytes per weight, embeddings dense
