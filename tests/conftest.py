import os
import tempfile

# Tests run on the CPU; sharding tests ask for 8 virtual devices in their own subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run (both xdist workers, every test module, every
# subprocess a test starts): the tiny models' programs are compiled once, not once per module. Every
# program is kept, however fast it compiled: on the tiny models most compile in well under a second,
# and each module would compile them again (measured on one server module: 36 s of CPU with a
# 0.5 s threshold against 32 s with none, warm).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zoo-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import pytest  # noqa: E402  (after the environment above: importing jax must see it)


@pytest.fixture(scope="session")
def audit_files(tmp_path_factory):
    """A reference GGUF and its quantized copy (``tests.support.audit_files``)."""
    from tests.support.audit_files import write_audit_files
    return write_audit_files(tmp_path_factory)


# The test modules that take longest (most of their time in subprocesses: several processes, notebook
# kernels, servers), heaviest first. The suite runs with ``--dist loadfile --no-loadscope-reorder``
# (scripts/bootstrap.sh): each worker takes whole modules in this order, so the long ones start first
# and the run does not end on one worker finishing a long module alone (xdist's default order, by
# number of tests, put these last).
HEAVY_FIRST = [
    "tests/sharding/test_multihost_serve.py",
    "tests/sharding/test_multihost.py",
    "tests/examples/test_serving_notebooks.py",
    "tests/sharding/test_sharding.py",
    "tests/test_packaging.py",
    "tests/examples/test_prepare_notebook.py",
    "tests/examples/test_audit_notebook.py",
    "tests/test_kaggle.py",
    "tests/weight_cache/test_store_mesh.py",
    "tests/train/test_sharded_step.py",
    "tests/test_cli_serve_lifecycle.py",
    "tests/test_cli_serve.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))   # stable: the rest keep their order
