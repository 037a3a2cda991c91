"""Several processes, one model: JAX's multi-controller runtime, started with clear errors.

    zoo.distributed.initialize("10.0.0.1:8476", num_processes=2, process_id=0)   # before any jax use
    model = zoo.load(...)      # every process: the same call; each reads only its own devices' slices
    ...                        # every process runs the same programs in the same order

Each process sees only its own (local) devices; after ``initialize`` the global device list
(``jax.devices()``) holds every process's, ``zoo.sharding.mesh.make_mesh`` lays a mesh over all of
them, and every parameter is one global array over that mesh (``zoo.sharding.placement`` reads and
places only the shards of this process's devices). On TPU slices and SLURM/Open MPI clusters JAX
detects the coordinator, process count and id itself: ``initialize()`` with no arguments.

On CPU (tests, and hosts without accelerators) the processes' collectives run over gloo (TCP).

Failures are errors, not hangs. An unreachable coordinator raises ``DistributedError`` after
``timeout_s``. When fewer processes join than the coordinator waits for (a process count the
processes do not agree on, a process that never started), XLA would end the process itself
(LOG(FATAL)) at its registration deadline; a watchdog prints a ``DistributedError`` line naming the
coordinator, the count and the id first and exits with status 2.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import jax

XLA_GRACE_S = 10       # XLA's own registration timeout runs this much past ours (ours speaks first)
ENV = {"coordinator": "ZOO_COORDINATOR", "num_processes": "ZOO_NUM_PROCESSES", "process_id": "ZOO_PROCESS_ID"}


class DistributedError(RuntimeError):
    """The multi-process runtime could not start (or was started twice with other settings)."""


def from_env() -> dict:
    """``initialize``'s arguments from ``ZOO_COORDINATOR``, ``ZOO_NUM_PROCESSES`` and ``ZOO_PROCESS_ID``
    (the ones set; empty when none is)."""
    out = {}
    for key, var in ENV.items():
        value = os.environ.get(var)
        if value:
            out[key] = value if key == "coordinator" else _int(var, value)
    return out


def cluster_size() -> int:
    """The processes of a cluster JAX detects on its own (a multi-host TPU slice, SLURM, Open MPI, ...),
    1 when there is none: where this is > 1, ``initialize()`` needs no arguments."""
    from jax._src.clusters import ClusterEnv

    for env in ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return int(env.get_process_count())
        except Exception:                           # a detector that cannot tell (no metadata server, ...)
            continue
    return 1


def _int(what: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} must be an integer, got {value!r}") from None


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Argument errors before any connection: all three or none; ``0 <= process_id < num_processes``;
    ``coordinator`` is ``HOST:PORT``."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise DistributedError("give the coordinator address, the number of processes and this process's id "
                               "together (or none of them, where JAX detects the cluster: TPU slices, SLURM)")
    if not any(given):
        return
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"coordinator address must be HOST:PORT, got {coordinator!r}")
    if num_processes < 1:
        raise DistributedError(f"the number of processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"process id {process_id} is outside 0..{num_processes - 1}")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               timeout_s: int = 120, heartbeat_s: int = 30) -> None:
    """Join the job (see module doc). Call before any other JAX call in the process. With a single
    process (``num_processes == 1``) nothing is started. ``heartbeat_s``: how long the coordinator
    waits for a silent process before declaring it dead (every other process then fails)."""
    if num_processes is not None:
        num_processes = _int("the number of processes", num_processes)
    if process_id is not None:
        process_id = _int("the process id", process_id)
    check_args(coordinator, num_processes, process_id)
    if num_processes == 1:
        return
    if jax.distributed.is_initialized():
        if num_processes not in (None, jax.process_count()) or process_id not in (None, jax.process_index()):
            raise DistributedError(f"the distributed runtime is already running as process {jax.process_index()} "
                                   f"of {jax.process_count()}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")     # the CPU client's; TPU/GPU have their own
    deadline = time.monotonic() + timeout_s
    if coordinator is not None and process_id:
        _wait_reachable(coordinator, deadline)
    # XLA ends the process itself (LOG(FATAL)) when registration times out, e.g. when fewer processes
    # come than the coordinator waits for: a watchdog says why first and exits with status 2
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _give_up,
                               (coordinator, num_processes, process_id, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=int(timeout_s) + XLA_GRACE_S,
                                   heartbeat_timeout_seconds=int(heartbeat_s),
                                   shutdown_timeout_seconds=int(heartbeat_s))
    except Exception as e:                                      # grpc / XLA status errors, several kinds
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if coordinator is None:
            raise DistributedError(f"no cluster detected (TPU slice, SLURM, Open MPI); give the coordinator address, "
                                   f"the number of processes and this process's id ({why})") from e
        raise DistributedError(
            f"could not join coordinator {coordinator} as process {process_id} of {num_processes} within "
            f"{timeout_s} s: is the coordinator reachable, and does every process give the same number of "
            f"processes? ({why})") from e
    finally:
        watchdog.cancel()


def _wait_reachable(coordinator: str, deadline: float) -> None:
    """Wait until something listens at ``coordinator`` (process 0 starts the service); past
    ``deadline``, ``DistributedError``."""
    host, _, port = coordinator.rpartition(":")
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(f"the coordinator {coordinator} is unreachable ({e}): is process 0 running, "
                                       f"and is this its address?") from None
            time.sleep(0.2)


def _give_up(coordinator, num_processes, process_id, timeout_s) -> None:
    print(f"zoo.distributed.DistributedError: process {process_id} could not join coordinator {coordinator} "
          f"within {timeout_s} s: {num_processes} processes must join it, each with the same number of "
          f"processes and its own id; fewer came", file=sys.stderr, flush=True)
    os._exit(2)
