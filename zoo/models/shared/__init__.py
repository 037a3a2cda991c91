"""What every model shares: layers, the MTP head, the ``CausalLM`` base, cache containers,
inventory and GGUF-metadata helpers."""
