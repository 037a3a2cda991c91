"""The HTTP server over the engine: the app and its transport, the engine thread, the chat service
(prompts in, answer events out), request validation, metrics, structured-output and image inputs,
logprob rendering; each API surface in ``protocols/``."""
