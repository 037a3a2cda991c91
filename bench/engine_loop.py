"""The engine on its own thread, as the server drives it, for the benches that time token arrivals
(``interleave``, ``idle_rows``, ``mask_share``; run them with ``PYTHONPATH=.``).

    with engine_running(gen): ...       Generator.run_forever on a thread, stopped and joined on the way out
    on_tokens=arrival_clock(times)      a request callback: one perf_counter time per token into ``times``
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

from zoo.engine.generator import Generator


@contextlib.contextmanager
def engine_running(gen: Generator, idle_wait: float = 0.001):
    stop = threading.Event()
    thread = threading.Thread(target=gen.run_forever, args=(stop, idle_wait), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def arrival_clock(times: list[float]) -> Callable:
    return lambda req, tokens: times.extend([time.perf_counter()] * len(tokens))
