"""The ops every layer calls (``matmul``, ``moe``, ``swiglu``), dispatching on the stored weight type."""
