"""Text: the tokenizer with its chat template, and the vocabulary a GGUF embeds."""
