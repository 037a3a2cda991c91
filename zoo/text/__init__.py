"""Text: the tokenizer with its chat template, the vocabulary a GGUF embeds, and what turns output
tokens into answer text with no HTTP and no device: the incremental detokenizer with stop strings
(``detokenize``), the reasoning splitter (``reasoning_parser``) and the tool-call formats
(``tool_calls``)."""
