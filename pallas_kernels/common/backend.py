"""The one place that decides how Pallas kernels run (docs/pallas_triton.md).

- On a GPU backend kernels compile through the Triton lowering with `pltriton.CompilerParams`.
- Anywhere else (CI's CPUs) they run with `interpret=True`.
- `GDP_PALLAS_INTERPRET=1` forces interpret mode (for debugging on a GPU machine).

jax 0.11+ marks the Pallas Triton backend deprecated (warning id `jax-pallas-triton`); we use it on
purpose and keep that warning out of users' output. Every kernel calls `pallas_call` from here, so
a later move (Mosaic GPU, or jax-triton) touches this module only.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated", category=DeprecationWarning)

HIGHEST = jax.lax.Precision.HIGHEST


def interpret_mode() -> bool:
  """True when kernels should run in the Pallas interpreter instead of compiling for a GPU."""
  if os.environ.get("GDP_PALLAS_INTERPRET", "") not in ("", "0"):
    return True
  return jax.default_backend() != "gpu"


def pallas_call(kernel, *, num_warps=4, num_stages=2, **kwargs):
  """`pl.pallas_call` with our backend choice: Triton params on GPU, interpret mode elsewhere."""
  if interpret_mode():
    return pl.pallas_call(kernel, interpret=True, **kwargs)
  params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(kernel, compiler_params=params, **kwargs)


# Float32 matmul precisions (half-precision operands always use the tensor cores with float32
# accumulation). See docs/precision.md.
PRECISIONS = ("tf32", "tf32x3", "ieee")
_GPU_ALGORITHM = {
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
}


def dot(a, b, *, trans_a=False, trans_b=False, precision="ieee"):
  """2-D matmul with float32 accumulation (the only dot the Triton lowering has).

  `precision` applies when an operand is float32: "tf32" (tensor cores, 10-bit mantissa inputs),
  "tf32x3" (three TF32 products, close to float32) or "ieee" (float32 on the CUDA cores). In
  interpret mode (CPU) float32 dots are always computed in full float32. Half-precision
  operands always use the tensor cores with float32 accumulation.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
  ca = 0 if trans_a else 1
  cb = 1 if trans_b else 0
  algorithm = None
  if a.dtype == jnp.float32:
    algorithm = HIGHEST if interpret_mode() else _GPU_ALGORITHM[precision]
  return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=algorithm,
                             preferred_element_type=jnp.float32)
