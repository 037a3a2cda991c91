"""The engine: the continuous-batching ``Generator`` on the device and everything it drives (rows,
sampling, logprobs, MTP speculation, output constraints and their token masks, the prefix cache,
image prefill, thinking budgets, the multi-process replica). It never imports ``zoo.server``.
A request's options are one ``RequestOptions`` (``options.py``): checked once, carried unchanged
into the ``Request`` and across the replica channel; the engine ends a request at a stop string
(``zoo.text.detokenize``)."""
