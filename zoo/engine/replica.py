"""One engine over several processes: process 0 (the leader) decides, the others (followers) replay.

Every process of a multi-process job (``zoo.distributed``) holds the same ``Generator`` over the same
global model, and must run the same device programs in the same order. The generator's host logic is
deterministic given what it is told before each step: which requests arrived (their prompt ids and
their ``RequestOptions``: sampling, seed, stop ids and strings, grammar, thinking budget, choices,
...) and which were cancelled. So the leader publishes that, per step, through JAX's distributed
key-value store, and each follower applies it to its own generator and steps::

    leader                                   follower
    submit / cancel (any thread): queued      loop: plan n = get("zoo/plan/n") (blocks)
    step n: plan = the queue; put plan n            apply its submits and cancels
            apply it; Generator.step()              Generator.step()
    close: put a plan with "stop"            ends on a plan with "stop"

Only the leader's requests have callbacks (it serves HTTP); a follower's copies only drive its
programs. Plans are JSON; a request travels as its prompt ids and its options object
(``RequestOptions.to_json``, every field of it: an option added there needs no change here; the
output grammar as its ``OutputGrammar``, each process compiles its own matcher). Stop strings are
matched by each process's engine, so the followers end a request where the leader does. Nothing
the engine decides may depend on a timing: a constrained row waits for its mask however long it
takes (``MaskSchedule.share`` None; on one process a late mask sits the row out instead). The
speculation policy and the prefill's time budget decide from step costs the leader timed: each plan
carries their tables (``SpecPolicy.export``, ``PrefillPace.export``), which every process, the leader
too, loads before the step.

``Leader`` has the generator methods the server's engine thread uses (``make_request``, ``submit``,
``cancel``, ``run_forever``, ``faults``, ...), so ``zoo serve`` puts it where a ``Generator`` would
be; ``zoo.engine.replica_watch`` keeps the processes' liveness.
"""

from __future__ import annotations

import json
import threading
import time

from zoo.engine.options import RequestOptions

PLAN_KEY = "zoo/plan"


class Channel:
    """Plans by step number over the job's key-value store (``jax.distributed``)."""

    def __init__(self, client=None, prefix: str = PLAN_KEY):
        if client is None:
            from jax._src.distributed import global_state
            client = global_state.client
            if client is None:
                raise RuntimeError("the distributed runtime is not running (zoo.distributed.initialize)")
        self.client, self.prefix = client, prefix

    def put(self, n: int, plan: dict) -> None:
        self.client.key_value_set_bytes(f"{self.prefix}/{n}", json.dumps(plan).encode())

    def get(self, n: int, timeout_s: float) -> dict:
        return json.loads(self.client.blocking_key_value_get_bytes(f"{self.prefix}/{n}", int(timeout_s * 1000)))

    def poll(self, n: int, timeout_s: float | None, poll_s: float = 1.0) -> dict:
        """Plan ``n``, waiting up to ``timeout_s`` (None: for ever) in waits of ``poll_s``; the leader
        may idle for hours. Past ``timeout_s``, ``TimeoutError``; a lost coordinator (the leader's
        process is gone) raises what the runtime raised."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = poll_s if deadline is None else max(0.001, min(poll_s, deadline - time.monotonic()))
            try:
                return self.get(n, wait)
            except Exception as e:                     # the runtime's status errors are plain exceptions
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no plan {n} from the leader within {timeout_s} s")

    def drop_below(self, n: int, start: int) -> None:
        """Delete plans ``start`` .. ``n - 1`` (every process has applied them)."""
        for i in range(start, n):
            self.client.key_value_delete(f"{self.prefix}/{i}")


def request_args(req) -> dict:
    """The JSON-able arguments that rebuild request ``req`` (its first choice) on another process:
    its prompt ids and ``options.to_json()``."""
    return {"prompt": [int(t) for t in req.prompt], "options": req.options.to_json()}


def replay_request(generator, args: dict):
    """The request ``request_args`` described, made by ``generator`` (a follower's)."""
    return generator.make_request(args["prompt"], RequestOptions.from_json(args["options"]))


class Leader:
    """Process 0's side: the engine's ``make_request`` / ``submit`` / ``cancel`` / ``step`` with every
    step's arrivals and cancellations published first (see the module doc). A request's id in the
    plans is ``req.replica_id``, given at submit (its other choices share it)."""

    def __init__(self, generator, channel: Channel):
        self.gen, self.channel = generator, channel
        generator.mask_schedule.share = None            # no step decided by a timing (every process decides alike)
        self.n = 0
        self._lock = threading.Lock()
        self._events: list[tuple[str, object]] = []     # ("submit" | "cancel", request) since the last step
        self._next_id = 0
        self.closed = False

    # what the server reads off a generator
    vocab = property(lambda self: self.gen.vocab)
    faults = property(lambda self: self.gen.faults)
    prefix = property(lambda self: self.gen.prefix)

    def constraints(self, grammar, n: int = 1):
        return self.gen.constraints(grammar, n)

    def warmup(self, progress=None):
        """``Generator.warmup`` (every follower runs its own, in the same order, before replaying)."""
        return self.gen.warmup(progress)

    def make_request(self, prompt, options: RequestOptions | None = None, **kwargs):
        """``Generator.make_request``, refusing what the followers cannot replay: images (they would
        prefill without them and drift from process 0), constraints without their grammar."""
        if kwargs.get("images"):
            raise ValueError("images are not served over several processes yet: serve the model on one host "
                             "for image requests")
        req = self.gen.make_request(prompt, options, **kwargs)
        if kwargs.get("constraints") is not None and req.options.grammar is None:
            raise ValueError("a replicated request's constraints need their grammar (the followers build their own)")
        req.replica_args = request_args(req)
        return req

    def submit(self, req):
        if self.closed:
            raise RuntimeError("the replicated engine is closed")
        self.gen.check(req)                             # refused here (a 400), not at the step, on every process
        with self._lock:
            for member in [req] + req.forks:
                member.replica_id = self._next_id
            self._next_id += 1
            self._events.append(("submit", req))
        self.gen._wakeup.set()
        return req

    def cancel(self, req) -> None:
        with self._lock:
            if getattr(req, "replica_id", None) is not None:
                self._events.append(("cancel", req))
            else:                                       # never published: only this process has it
                self.gen.cancel(req)
        self.gen._wakeup.set()

    def has_work(self) -> bool:
        return bool(self._events) or self.gen.has_work()

    def step(self) -> bool:
        with self._lock:
            events, self._events = self._events, []
        plan = {"events": [{"submit": r.replica_id, "args": r.replica_args} if kind == "submit"
                           else {"cancel": r.replica_id, "choice": r.choice} for kind, r in events]}
        policy = self.gen.spec_policy
        if policy is not None and policy.mode == "auto":    # the step costs it decides from, as the followers
            plan["spec"] = json.loads(json.dumps(policy.export()))
            policy.load(plan["spec"])
        plan["pace"] = json.loads(json.dumps(self.gen.pace.export()))    # the prefill's time budget, alike
        self.gen.pace.load(plan["pace"])
        self.channel.put(self.n, plan)
        self.n += 1
        for kind, req in events:
            (self.gen.submit if kind == "submit" else self.gen.cancel)(req)
        return self.gen.step()

    def run_forever(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """The engine thread's loop (``Generator.run_forever``'s): step while there is work (an idle
        leader publishes nothing); at the end the followers are told to stop."""
        try:
            while not stop.is_set():
                if not self.has_work() or not self.step():
                    self.gen._wakeup.wait(idle_wait)
                    self.gen._wakeup.clear()
        finally:
            self.close()

    def close(self) -> None:
        """Tell the followers to stop (once)."""
        if not self.closed:
            self.closed = True
            self.channel.put(self.n, {"stop": True})


class Follower:
    """A follower process's side: replay the leader's plans on ``generator`` until one says stop."""

    def __init__(self, generator, channel: Channel):
        self.gen, self.channel = generator, channel
        generator.mask_schedule.share = None            # as the leader's: every mask is waited for
        self.reqs: dict[int, object] = {}
        self.n = 0                                      # plans applied

    def run(self, timeout_s: float | None = None, warmup: bool = False) -> int:
        """Replay until the leader stops (``timeout_s``: the longest wait for one plan; None: no
        limit, the leader may idle); returns the steps replayed. ``warmup`` first runs the
        generator's warmup (process 0 runs its own: their programs' collectives pair up)."""
        if warmup:
            self.gen.warmup()
        while True:
            plan = self.channel.poll(self.n, timeout_s)
            if plan.get("stop"):
                return self.n
            for e in plan["events"]:
                if "submit" in e:
                    self.reqs[e["submit"]] = self.gen.submit(replay_request(self.gen, e["args"]))
                elif e["cancel"] in self.reqs:
                    first = self.reqs[e["cancel"]]
                    self.gen.cancel(([first] + first.forks)[e.get("choice", 0)])
            if "spec" in plan:
                self.gen.spec_policy.load(plan["spec"])
            if "pace" in plan:
                self.gen.pace.load(plan["pace"])
            self.gen.step()
            self.n += 1
            self.reqs = {i: r for i, r in self.reqs.items() if not all(m.done.is_set() for m in [r] + r.forks)}
