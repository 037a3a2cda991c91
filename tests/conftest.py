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
