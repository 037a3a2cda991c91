"""GLM-5.3 (HF ``glm5_next``, GGUF ``glm5next``): config, KDA, MLA with the k-pool indexer,
hyper-connections, MoE, model, weight maps, GGUF config table, tensor inventory, recipes."""
