"""Qwen3.8 (HF ``qwen3_5``, GGUF ``qwen35``): config, gated DeltaNet, gated attention, model, weight
maps, GGUF config table, tensor inventory, recipes."""
