"""What the committed llama.cpp GGUF fixtures (tests/data) hold, as the tests need it."""

# The two llama.cpp GLM fixtures, as configs (read off their GGUF metadata).
GLM_FIXTURES = {
    "glm53-q256-udmix.gguf": dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, v_head_dim=64,
        index_n_heads=8, index_head_dim=64, index_kpool=4, index_topk=16, linear_num_heads=4, linear_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full", "full", "shared", "full"]),
    "glm53-tiny-mtp-f32.gguf": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=16, linear_num_heads=4, linear_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, num_nextn_predict_layers=1,
        layer_types=["linear_attention"] * 3 + ["indexed_attention"] * 2 + ["linear_attention"] * 2
        + ["indexed_attention"], mlp_layer_types=["dense"] + ["sparse"] * 7,
        indexer_types=["full"] * 4 + ["shared"] + ["full"] * 3),
}
ROUTED_EXPERT_BYTES = 109_867_696_128          # docs/reference.md section 3: layers 3-44, UD-IQ3_XXS
