"""Load time: filling an abstract model from a source, GGUF metadata, what a recipe means at
load, and the abstract load (no file read)."""
