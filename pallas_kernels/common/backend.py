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

# Imported here, not on a kernel's first call: jax imports Pallas's fuser lazily during the first
# pallas_call, and it registers a config option that is part of jax's tracing context. A jitted
# function traced before that import would then miss its cache on the next call and compile again
# (docs/implementations.md#compiled-once). `import gdp_jax` imports this module.
from jax.experimental.pallas import fuser as _pallas_fuser  # noqa: F401
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings(
  "ignore", message=r"The Pallas Triton backend is deprecated", category=DeprecationWarning
)

HIGHEST = jax.lax.Precision.HIGHEST


def interpret_mode() -> bool:
  """True when kernels should run in the Pallas interpreter instead of compiling for a GPU."""
  if os.environ.get("GDP_PALLAS_INTERPRET", "") not in ("", "0"):
    return True
  return jax.default_backend() != "gpu"


def pallas_call(kernel, *, num_warps=4, num_stages=2, **kwargs):
  """`pl.pallas_call` with our backend choice: Triton params on GPU, interpret mode elsewhere.

  Inside `jax.shard_map` (with its default `check_vma=True`) every output is typed as varying
  over the mesh axes any input varies over (see `_varying_out_shape`), so the kernels run per
  shard unchanged (docs/sharding.md).
  """
  if interpret_mode():
    call = pl.pallas_call(kernel, interpret=True, **kwargs)
  else:
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    call = pl.pallas_call(kernel, compiler_params=params, **kwargs)
  out_shape = kwargs.get("out_shape")

  def run(*args):
    typed = _varying_out_shape(out_shape, args)
    if typed is out_shape:
      return call(*args)
    kw = dict(kwargs, out_shape=typed)
    if interpret_mode():
      return pl.pallas_call(kernel, interpret=True, **kw)(*args)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, compiler_params=params, **kw)(*args)

  return run


def barrier():
  """Inside a kernel: a barrier of the program's threads (their memory operations before it are
  done for all of them after it). Nothing in interpret mode, where a program is one thread."""
  if not interpret_mode():
    pltriton.debug_barrier()


def _varying_axes(x):
  """(mesh axes x varies over inside shard_map, the type that records them) for either jax API:
  `aval.manual_axis_type.varying`, or `aval.vma` in older jax (type None)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying), type(mat)
  return frozenset(getattr(aval, "vma", None) or ()), None


def _varying_out_shape(out_shape, args):
  """out_shape with each ShapeDtypeStruct typed as varying over the union of the inputs'
  varying mesh axes (none outside shard_map, or when every input is replicated: shard_map's
  check still wants the type set)."""
  axes, mat_type, arrays = frozenset(), None, False
  for a in jax.tree.leaves(args):
    if hasattr(a, "shape") and hasattr(a, "dtype"):
      a_axes, a_type = _varying_axes(a)
      axes, mat_type, arrays = axes | a_axes, mat_type or a_type, True
  if not arrays or (mat_type is None and not axes):
    return out_shape

  def typed(s):
    if not isinstance(s, jax.ShapeDtypeStruct):
      return s
    if mat_type is not None:
      return jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat_type(varying=axes))
    return jax.ShapeDtypeStruct(s.shape, s.dtype, vma=axes)

  return jax.tree.map(typed, out_shape, is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))


# Float32 matmul precisions (half-precision operands always use the tensor cores with float32
# accumulation). See docs/precision.md.
PRECISIONS = ("tf32", "tf32x3", "ieee")
_GPU_ALGORITHM = {
  "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
  "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
  "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
}


def resolve_precision(precision=None) -> str:
  """The float32 matmul precision of the kernels for a user's `precision` argument.

  None follows `jax.default_matmul_precision` (as jnp.dot does): its default, "default",
  "bfloat16", "tensorfloat32" and "high" give "tf32" (what XLA uses for float32 on these GPUs);
  "highest" and "float32" give "tf32x3" (three TF32 products: close to float32 on the tensor
  cores). The kernels' own names ("tf32", "tf32x3", "ieee") and `jax.lax.Precision` values are
  accepted too. See docs/precision.md.
  """
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  if isinstance(precision, jax.lax.Precision):
    precision = {
      jax.lax.Precision.DEFAULT: "default",
      jax.lax.Precision.HIGH: "high",
      jax.lax.Precision.HIGHEST: "highest",
    }[precision]
  if precision is None or precision in (
    "default",
    "bfloat16",
    "tensorfloat32",
    "high",
    "fastest",
    "ANY_F32_F32",
  ):
    return "tf32"
  if precision in ("highest", "float32"):
    return "tf32x3"
  if precision in PRECISIONS:
    return precision
  raise ValueError(
    f"precision must be None, 'default', 'high', 'highest', one of {PRECISIONS} "
    f"or a jax.lax.Precision, got {precision!r}"
  )


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
  return jax.lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ())), precision=algorithm, preferred_element_type=jnp.float32
  )
