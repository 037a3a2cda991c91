"""Serving: the continuous-batching generator with MTP speculative decoding, the engine thread, the
OpenAI / Anthropic server, and ahead-of-time compilation of the engine's programs (``aot``)."""
