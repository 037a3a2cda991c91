import os
import tempfile

# Tests run on the CPU; sharding tests ask for 8 virtual devices in their own subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run (both xdist workers, every test module, every
# subprocess a test starts): the tiny models' programs are compiled once, not once per module.
# Programs that took over 0.5 s to compile are kept. Keeping every one was tried (18b7c0e: one server
# module took 32 s of CPU warm against 36 s with the threshold) and undone with that stop's
# scheduling change (ae13501); the threshold has been measured in whole runs since.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zoo-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# The tiny models' programs take longer to compile than to run: the CPU backend compiles without
# LLVM's expensive optimizations (the programs compute the same; measured on two engine test files,
# cold: 23% less CPU time). Subprocesses inherit it; those that set a device count append theirs.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (FAST_COMPILE + " " + os.environ.get("XLA_FLAGS", "")).strip()


def _pin_xdist_worker() -> None:
    """Each xdist worker on cores of its own (worker i of n on every n-th allowed core from the i-th:
    on 2 cores and 2 workers, one core each), and every process it starts on all of them again. With
    both workers free to use both cores, each process's XLA thread pools (run and compile) spread over
    both and contended with the other worker's: the same two test files run by two processes at once
    took 57 s each unpinned and 45.5 s each pinned (53 s of user CPU against 42.5). Processes a test
    starts (servers, multi-process jobs, notebooks' kernels) are spawned with the whole set, as before.
    ``ZOO_TEST_PIN=0``: no pinning."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if (not worker.startswith("gw") or count < 2 or os.environ.get("ZOO_TEST_PIN") == "0"
            or not hasattr(os, "sched_setaffinity")):
        return
    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        return
    i = int(worker[2:])
    own = set(every[i::count]) if i < len(every) else {every[i % len(every)]}     # a share of the cores each
    os.sched_setaffinity(0, own)      # this thread, and every thread it starts from now on (XLA's pools)

    import subprocess

    spawn = subprocess.Popen._execute_child

    def _execute_child(self, *args, **kwargs):          # the child inherits the spawning thread's set
        os.sched_setaffinity(0, every)
        try:
            return spawn(self, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, own)
    subprocess.Popen._execute_child = _execute_child


_pin_xdist_worker()

import pytest  # noqa: E402  (after the environment above: importing jax must see it)


@pytest.fixture(scope="session")
def audit_files(tmp_path_factory):
    """A reference GGUF and its quantized copy (``tests.support.audit_files``)."""
    from tests.support.audit_files import write_audit_files
    return write_audit_files(tmp_path_factory)


# The heaviest files first: with ``--dist loadfile`` each xdist worker takes the next file when it
# finishes one, so long files started early keep both workers busy to the end, while the short ones
# fill in last (in collection order, the sharding files came near the end and one worker finished
# minutes before the other). ``scripts/bootstrap.sh`` passes ``--no-loadscope-reorder``: without it
# xdist sorts the files by their number of tests, which put the long multi-process files and the
# notebooks (few tests each) last. Seconds per file on 2 cores in a whole run, measured 2026-12-04.
# The other multi-process file comes after them, when test_multihost is long done: two multi-process
# jobs at once (4 JAX processes and their gloo collectives on 2 cores) took 2-3x as long as either
# alone.
HEAVY_FIRST = [
    "tests/sharding/test_multihost.py",              # ~440
    "tests/sharding/test_sharding.py",               # ~270
    "tests/examples/test_serving_notebooks.py",      # ~245
    "tests/engine/test_speculative.py",              # ~200
    "tests/tools/test_compile_report.py",            # ~195
    "tests/engine/test_prefix_cache.py",             # ~185
    "tests/train/test_training.py",                  # ~160
    "tests/weight_cache/test_build.py",              # ~130
    "tests/engine/test_images_compile_once.py",      # ~120
    "tests/engine/test_interleave.py",               # ~120
    "tests/server/test_agent_clients.py",            # ~96 (junit, 2026-12-05)
    "tests/kernels/test_decode.py",                  # ~89
    "tests/train/test_fit_mtp.py",                   # ~87
    "tests/kernels/test_model.py",                   # ~86
    "tests/engine/test_generator_images.py",         # ~77
    "tests/server/test_structured.py",               # ~74
    "tests/test_demo_models.py",                     # ~64
    "tests/sharding/test_multihost_serve.py",        # ~110 alone, ~300 beside test_multihost
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))    # stable: files stay whole
