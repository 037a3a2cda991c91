"""Liveness of a replicated engine's processes (``zoo.engine.replica``), over JAX's key-value store.

    follower: Heartbeat(client, process_id, progress).start()   every ``interval_s``: zoo/alive/<id> =
                                                             {"beat": count, "plan": progress()}
              heartbeat.fail(message)                        zoo/failed/<id> = message (it is exiting)
    leader:   Watchdog(client, followers, timeout_s, on_failure, channel).start()

The watchdog reads every follower's beat each ``interval_s``. A follower whose beat has not changed
for ``timeout_s`` (its process died, or hangs: a stopped process beats no more), or that said it
failed, is reported once through ``on_failure(message)``, which the server uses to end the requests
in flight with that message and exit non-zero. A follower's beat comes from its own thread, so a
long compilation or load is not a hang. The watchdog also deletes the plans every follower has
applied (``Channel.drop_below``), so the store stays small however long the server runs.

JAX's own runtime ends every process (LOG(FATAL)) when one misses its heartbeats for its
``heartbeat_timeout``: ``timeout_s`` must be shorter, so that the clear error comes first.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("zoo.serve")
ALIVE_KEY, FAILED_KEY = "zoo/alive", "zoo/failed"


class Heartbeat:
    """A follower's beat: a daemon thread writing its count and ``progress()`` (the plans it has
    applied, ``Follower.n``) every ``interval_s``."""

    def __init__(self, client, process_id: int, progress: Callable[[], int] = lambda: 0, interval_s: float = 0.5):
        self.client, self.id, self.interval_s, self.progress = client, process_id, interval_s, progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zoo-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def fail(self, message: str) -> None:
        """Tell the leader why this process is about to exit (best effort)."""
        try:
            self.client.key_value_set_bytes(f"{FAILED_KEY}/{self.id}", message.encode(), allow_overwrite=True)
        except Exception:                               # the coordinator may be gone already
            pass

    def _run(self) -> None:
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self.client.key_value_set_bytes(f"{ALIVE_KEY}/{self.id}",
                                                json.dumps({"beat": beat, "plan": self.progress()}).encode(),
                                                allow_overwrite=True)
            except Exception:                           # the coordinator is gone: the runtime ends us
                return
            self._stop.wait(self.interval_s)


class Watchdog:
    """The leader's view of the followers' beats (see the module doc)."""

    def __init__(self, client, followers: list[int], timeout_s: float, on_failure: Callable[[str], None],
                 channel=None, interval_s: float = 0.5, processes: int | None = None):
        self.client, self.followers, self.timeout_s = client, list(followers), float(timeout_s)
        self.on_failure, self.channel, self.interval_s = on_failure, channel, interval_s
        self.processes = processes or len(self.followers) + 1
        self.failure: str | None = None
        self._failed = threading.Event()
        self._beats: dict[int, str | None] = {i: None for i in self.followers}
        self._seen = {i: time.monotonic() for i in self.followers}
        self._plans = {i: 0 for i in self.followers}
        self._dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zoo-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """Read every follower once; the failure found (also kept in ``failure``), or None."""
        now = time.monotonic()
        for i in self.followers:
            failed = self._try_get(f"{FAILED_KEY}/{i}")
            if failed is not None:
                return self._fail(f"process {i} of {self.processes} failed: {failed}")
            beat = self._try_get(f"{ALIVE_KEY}/{i}")
            if beat is not None and beat != self._beats[i]:
                self._beats[i], self._seen[i] = beat, now
                self._plans[i] = int(json.loads(beat)["plan"])
            elif now - self._seen[i] > self.timeout_s:
                return self._fail(f"process {i} of {self.processes} stopped responding (no heartbeat for "
                                  f"{self.timeout_s:g} s): it died or hangs")
        if self.channel is not None and self.followers:
            done = min(self._plans.values())
            if done > self._dropped:
                self.channel.drop_below(done, self._dropped)
                self._dropped = done
        return None

    def settle(self) -> None:
        """Called by the engine when a step failed (on several processes, most often because one
        died mid-collective): wait for the verdict on the followers, up to ``timeout_s`` and two
        reads more. A failure found means ``on_failure`` is ending the job: this then never returns,
        so the requests get its message rather than the collective's; else it returns."""
        if self._failed.wait(self.timeout_s + 2 * self.interval_s):
            threading.Event().wait()

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get_bytes(key).decode()
        except Exception as e:                          # NOT_FOUND: not written yet
            if "NOT_FOUND" in str(e):
                return None
            raise

    def _fail(self, message: str) -> str:
        if self.failure is None:
            self.failure = message
            self._failed.set()
            log.error("%s", message)
            self.on_failure(message)
        return message

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.failure is None:
            try:
                self.check()
            except Exception as e:                      # the store itself failed: nothing can be replayed
                self._fail(f"the job's key-value store failed: {type(e).__name__}: {e}")
