"""The one place that decides how a quantized matmul or expert bank is computed.

``zoo.quant.qarray`` registers :func:`quantized_matmul` and :func:`quantized_moe` as the QArray
implementations of ``zoo.ops.matmul.matmul`` / ``zoo.ops.moe.moe``. The rule, per call (at
trace time, from static shapes):

1. **format**: a ggml type without a tile decoder (``zoo.kernels.tile_decoders``) is dequantized whole
   (``QArray.dequantize``, bit-exact with gguf) and computed densely;
2. **rows**: up to ``Policy.decode_rows`` rows (decode: the streams of a step, or the k+1 tokens of
   a speculative verify) take the fused dequant-matvec with de-duplicated experts
   (``zoo.kernels.dequant_matvec``); more rows (prefill) take the grouped GEMM over expert-sorted
   row blocks (``zoo.kernels.grouped_matmul``);
3. **backend**: on TPU the Pallas (Mosaic) kernels; on GPU the Triton decode kernels
   (``zoo.kernels.dequant_matvec_gpu``) where their power-of-two and shared-memory constraints
   hold, and for prefill the jnp references (XLA's own GEMMs on the decoded weights); on CPU the
   jnp references, which decode with the same tile decoders. One exception measured on an H200
   (``bench/gpu_kernels.py``): a 2-D weight of a codebook format (IQ*: a table gather per weight)
   is dequantized whole then multiplied, 70 us against the Triton kernel's 286 us for 4096 x 4096
   IQ2_S at 3 rows (the kernel reads the whole matrix either way).

A :class:`Policy` overrides the backend (tests run the Pallas bodies on CPU with ``interpret``) or
the thresholds; set it with :func:`use_policy` around the *tracing* of a program (a jitted function
keeps what it was traced with).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Callable, Literal

import jax

from zoo.kernels import dequant_matvec as mv
from zoo.kernels import dequant_matvec_gpu as mv_gpu
from zoo.kernels import grouped_matmul as gm
from zoo.kernels.tile_decoders import format_of
from zoo.ops.matmul import decode_after, dense_matmul
from zoo.ops.moe import dense_moe

Backend = Literal["auto", "tpu", "gpu", "reference", "dequantize"]


@dataclass(frozen=True)
class Policy:
    """``backend``: "auto" (by ``jax.default_backend()``), "tpu" (Pallas Mosaic kernels), "gpu"
    (Pallas Triton kernels), "reference" (the jnp twins), "dequantize" (dequantize the whole weight,
    then dense); ``interpret``: run Pallas kernels in interpret mode (CPU tests); ``decode_rows``:
    the most rows that take the decode kernels; ``block_rows``: rows per block of the grouped GEMM
    (None: from the rows per expert)."""

    backend: Backend = "auto"
    interpret: bool = False
    decode_rows: int = 16
    block_rows: int | None = None


_POLICY: contextvars.ContextVar[Policy] = contextvars.ContextVar("zoo_kernel_policy", default=Policy())


@contextlib.contextmanager
def use_policy(policy: Policy):
    """Trace quantized matmuls / experts under ``policy`` inside the ``with`` block."""
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def current_policy() -> Policy:
    return _POLICY.get()


def backend_of(policy: Policy) -> str:
    """The backend a policy resolves to here: "tpu", "gpu", "reference" or "dequantize"."""
    if policy.backend != "auto":
        return policy.backend
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), "reference")


def block_rows(n_slots: int, n_experts: int, policy: Policy) -> int:
    """Rows per grouped-GEMM block: the expected rows per expert, as a power of two in [16, 128]
    (16: a whole bf16 sublane tile)."""
    if policy.block_rows is not None:
        return policy.block_rows
    per_expert = -(-n_slots // n_experts)
    return min(128, max(16, 1 << (per_expert - 1).bit_length()))


def dequantized_matmul(x: jax.Array, w, out_dtype) -> jax.Array:
    """Dequantize the whole matrix (``QArray.dequantize``, bit-exact with gguf; after ``x`` exists:
    ``decode_after``), then ``jnp.dot``."""
    x, w = decode_after(x, w)
    return dense_matmul(x, w.dequantize().astype(x.dtype), out_dtype)


def dequantized_moe(x, weights, ids, gate, up, down, limit) -> jax.Array:
    """Dequantize every bank whole (after ``x`` exists), then ``dense_moe``."""
    x, banks = decode_after(x, (gate, up, down))
    return dense_moe(x, weights, ids, *(b.dequantize().astype(x.dtype) for b in banks), limit)


def matmul_impl(rows: int, w, policy: Policy) -> Callable:
    """``fn(x, w, out_dtype)`` for ``rows`` rows of a 2-D QArray ``w``."""
    backend = backend_of(policy)
    if backend == "dequantize" or format_of(w.qtype) is None:
        return dequantized_matmul
    decode = rows <= policy.decode_rows
    if backend == "tpu":
        if decode:
            return functools.partial(mv.linear_matvec, interpret=policy.interpret)
        bm = min(128, -(-rows // 16) * 16)
        return functools.partial(gm.linear_grouped, block_rows=bm, interpret=policy.interpret)
    if backend == "gpu" and decode and format_of(w.qtype).tables:
        return dequantized_matmul          # codebook gathers: the Triton kernel is 4x slower (docstring)
    if backend == "gpu" and decode and mv_gpu.supported(w):
        return functools.partial(mv_gpu.linear_matvec_gpu, interpret=policy.interpret)
    return mv.reference_linear


def moe_impl(rows: int, top_k: int, banks: tuple, policy: Policy) -> Callable:
    """``fn(x, weights, ids, gate, up, down, limit)`` for ``rows`` tokens routed to ``top_k`` experts."""
    backend = backend_of(policy)
    if backend == "dequantize" or any(format_of(b.qtype) is None for b in banks):
        return dequantized_moe
    decode = rows <= policy.decode_rows
    if backend == "tpu":
        if decode:
            return functools.partial(mv.moe_matvec, interpret=policy.interpret)
        bm = block_rows(rows * top_k, banks[0].shape[0], policy)
        return functools.partial(gm.moe_grouped, block_rows=bm, interpret=policy.interpret)
    if backend == "gpu" and decode and mv_gpu.supported(*banks):
        return functools.partial(mv_gpu.moe_matvec_gpu, interpret=policy.interpret)
    return mv.reference_moe if decode else gm.reference_moe


def quantized_matmul(x: jax.Array, w, out_dtype) -> jax.Array:
    """``x [..., in] @ w`` for a 2-D QArray, by :func:`matmul_impl` under the current policy."""
    if w.ndim != 2:
        raise ValueError(f"matmul needs a 2-D weight, got {w}; expert banks go through zoo.ops.moe")
    return matmul_impl(math.prod(x.shape[:-1]), w, current_policy())(x, w, out_dtype)


def quantized_moe(x, weights, ids, gate_bank, up_bank, down_bank, limit):
    """Routed experts over QArray banks (``zoo.ops.moe`` contract), by :func:`moe_impl`."""
    banks = (gate_bank, up_bank, down_bank)
    impl = moe_impl(x.shape[0], ids.shape[1], banks, current_policy())
    return impl(x, weights, ids, *banks, limit)


def attention_kernel() -> dict | None:
    """How a length-aware attention is computed under the current policy: the Pallas kernel's
    options (``zoo.kernels.ragged_attention``; ``{"interpret": ..}``) on the "tpu" backend, None
    (the jnp key blocks of ``zoo.models.shared.filled_blocks``) on every other."""
    policy = current_policy()
    return {"interpret": policy.interpret} if backend_of(policy) == "tpu" else None
