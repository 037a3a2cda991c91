"""The API surfaces: each one's request models beside its handlers (OpenAI chat and completions,
Responses, Anthropic Messages, tokenize / detokenize)."""
