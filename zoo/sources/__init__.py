"""Weight sources: safetensors, GGUF (local and remote), FP8 and joined/mixed views, the
``WeightSource`` contract (``base``) and the name-map machinery (``names``)."""
