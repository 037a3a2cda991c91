import os

# Tests run on the CPU; sharding tests ask for 8 virtual devices themselves.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
