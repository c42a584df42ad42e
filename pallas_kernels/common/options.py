"""Launch parameters and matmul precision of the kernels: one frozen options object.

`KernelOptions` carries everything a kernel launch needs besides its arrays: the float32 matmul
precision and, per stage, the Triton launch parameters (warps, pipeline stages, V tile). It is
frozen (hashable: it can be a static argument of `jax.jit` and of `jax.custom_vjp`).
`heuristic_options(...)` picks it from the problem (r, K, V, dtype) and the device (SM count,
shared memory); callers override single fields with `dataclasses.replace`. The default launches
are the ones measured fastest on an H200, read from pallas_kernels/triton/tuning/h200.json (with
the command and date of each; docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from absl import logging

from pallas_kernels.common import backend, shared_memory, tuning
from pallas_kernels.common.device import DeviceInfo, device_info


@dataclasses.dataclass(frozen=True)
class Launch:
  """Triton launch parameters of one kernel. `block_v`: V tile of kernels that split V;
  `block_k`: key column tile of kernels that split K (bwd_dqkwg, bwd_wy)."""

  num_warps: int = 4
  num_stages: int = 2
  block_v: int | None = None
  block_k: int | None = None


def pieces(launch: Launch, block_cols: int, dim_v: int) -> tuple[int, int]:
  """(BK, BV): the key columns (of a block of `block_cols`) and the V columns that a kernel
  walking K and V in pieces takes at a time (`launch.block_k`, `launch.block_v`; None: all)."""
  bk = block_cols if launch.block_k is None else min(launch.block_k, block_cols)
  bv = dim_v if launch.block_v is None else min(launch.block_v, dim_v)
  if block_cols % bk or dim_v % bv:
    raise ValueError(
      f"launch.block_k = {launch.block_k} must divide K / r = {block_cols} and launch.block_v = "
      f"{launch.block_v} must divide V = {dim_v}"
    )
  return bk, bv


def _tuned(kernel: str) -> Launch:
  """The launch of `kernel` measured on an H200 (the defaults on every GPU)."""
  return Launch(**tuning.launch(kernel))


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Precision and launch parameters of the chunked operator's kernels.

  precision: float32 matmuls: "tf32", "tf32x3" or "ieee" (docs/precision.md). Half-precision
    operands always run on the tensor cores with float32 accumulation.
  nonfinite_guard: run the kernels on cleaned inputs and mark the outputs a bad token spoils
    (selects around one run of the kernels) so that a nan or inf at token t changes nothing
    before t (docs/precision.md#non-finite-inputs; its cost: docs/performance.md). False skips
    it: a non-finite input may then also spoil the earlier tokens of its chunk.
  chunk_fwd_inverse: how chunk_fwd inverts its diagonal blocks (pallas_kernels/triton/forward/
    chunk_fwd.py; "auto" by the precision).
  Each stage field is the `Launch` of the kernel of the same name (docs/kernels.md).
  """

  precision: str = "tf32"
  nonfinite_guard: bool = True
  chunk_fwd: Launch = _tuned("chunk_fwd")
  chunk_fwd_inverse: str = "auto"
  chunk_state_output: Launch = _tuned("chunk_state_output")
  wy: Launch = _tuned("wy")
  chunk_h: Launch = _tuned("chunk_h")
  bwd_dv_local: Launch = _tuned("bwd_dv_local")
  bwd_dhu: Launch = _tuned("bwd_dhu")
  bwd_dqkwg: Launch = _tuned("bwd_dqkwg")
  bwd_wy: Launch = _tuned("bwd_wy")

  def __post_init__(self):
    if self.precision not in backend.PRECISIONS:
      raise ValueError(f"precision must be one of {backend.PRECISIONS}, got {self.precision!r}")

  def replace(self, **changes) -> KernelOptions:
    return dataclasses.replace(self, **changes)


DEFAULT = KernelOptions()

# The most tokens per chunk the operator gives the kernels for r key blocks
# (gdp_jax.ops.gated_delta_product.triton: BT = min(chunk_size, 64 // r), at least 16); the tiles
# only shrink with a smaller chunk.
MAX_CHUNK_ROWS = 64


def operator_problem(*, r: int, dim_k: int, dim_v: int, dtype, precision: str = "tf32"):
  """The tile sizes the operator's kernels see for q, k [.., K], v [.., V] and r key blocks: each
  key block and V padded to a power of two >= 16
  (gdp_jax.ops.gated_delta_product.triton.padded_dims) and the largest chunk (MAX_CHUNK_ROWS)."""
  dkp = max(16, 1 << max(dim_k // r - 1, 0).bit_length())
  vp = max(16, 1 << max(dim_v - 1, 0).bit_length())
  chunk = max(16, MAX_CHUNK_ROWS // r)
  return shared_memory.Problem(
    r=r, dim_k=r * dkp, dim_v=vp, chunk=chunk, dtype=jnp.dtype(dtype), precision=precision
  )


def _measured_on_h200(problem, device: DeviceInfo) -> tuple[str, ...]:
  """The kernels whose default launch compiled and ran on an H200 for `problem` (the tuning
  table's "compiled" entries), when `device` is that kind of GPU: measured beats estimated."""
  table = tuning.table()
  gpu = table["gpu"]
  if (
    device.compute_capability != tuple(gpu["compute_capability"])
    or device.shared_memory_per_block < gpu["shared_memory_per_block"]
  ):
    return ()
  precision = problem.precision if problem.dtype == jnp.float32 else "tf32"
  for entry in table["compiled"]["value"]:
    if (
      (entry["dtype"], entry["precision"]) == (jnp.dtype(problem.dtype).name, precision)
      and problem.r in entry["r"]
      and (problem.dim_k, problem.dim_v) == (entry["dim_k"], entry["dim_v"])
    ):
      return tuple(entry["kernels"])
  return ()


def _candidates(launch: Launch, dim_v: int):
  """Launches to try, in order of preference: the given one; then fewer pipeline stages (down
  to 2) before narrower V tiles (down to 16); a single stage (no pipelining) last."""
  yield launch
  widths: list[int | None] = [launch.block_v]
  if launch.block_v is not None:
    width = min(launch.block_v, dim_v)
    widths = [width]
    while width > 16:
      width //= 2
      widths.append(width)
  for floor in (2, 1):
    for bv in widths:
      for stages in range(launch.num_stages, floor - 1, -1):
        yield dataclasses.replace(launch, num_stages=stages, block_v=bv)


def fit_launch(kernel: str, launch: Launch, problem, device: DeviceInfo):
  """(launch, estimated bytes): the first candidate launch of `kernel` whose estimated shared
  memory (pallas_kernels/common/shared_memory.py) fits the device's per-block limit, or the
  smallest candidate when none does."""
  wgmma = shared_memory.has_wgmma(device)
  best = None
  for cand in _candidates(launch, problem.dim_v):
    size = shared_memory.estimate_bytes(
      kernel,
      problem,
      num_stages=cand.num_stages,
      num_warps=cand.num_warps,
      block=cand.block_v,
      block_k=cand.block_k,
      wgmma=wgmma,
    )
    if size <= device.shared_memory_per_block:
      return cand, size
    if best is None or size < best[1]:
      best = (cand, size)
  return best


def over_budget(
  opts: KernelOptions, *, r: int, dim_k: int, dim_v: int, dtype, device: DeviceInfo | None = None
) -> dict[str, int]:
  """The operator's kernels whose estimated shared memory with `opts` exceeds the device's per
  block limit ({kernel: estimated bytes}; empty when all fit). K, V as the caller gives them
  (padded here); launches measured to compile on the device count as fitting."""
  device = device_info() if device is None else device
  problem = operator_problem(r=r, dim_k=dim_k, dim_v=dim_v, dtype=dtype, precision=opts.precision)
  report = shared_memory.operator_report(
    opts,
    r=r,
    dim_k=problem.dim_k,
    dim_v=problem.dim_v,
    chunk=problem.chunk,
    dtype=problem.dtype,
    device=device,
  )
  measured = _measured_on_h200(problem, device)
  return {
    kernel: size
    for kernel, size in report.items()
    if size > device.shared_memory_per_block
    and not (kernel in measured and getattr(opts, kernel) == getattr(DEFAULT, kernel))
  }


@functools.cache
def heuristic_options(
  *,
  r: int,
  dim_k: int,
  dim_v: int,
  dtype,
  precision: str = "tf32",
  device: DeviceInfo | None = None,
) -> KernelOptions:
  """The launch configuration for a problem on a device (H200-tuned, scaled down elsewhere).

  Starts from the H200 defaults (`DEFAULT`) and, kernel by kernel, takes the first launch whose
  estimated shared memory per block (pallas_kernels/common/shared_memory.py, at the operator's
  padded tiles and largest chunk) fits `device.shared_memory_per_block`: fewer pipeline stages,
  then narrower V tiles, then no pipelining. Launches measured to compile on an H200 (the tuning
  table's "compiled" entries) are kept there whatever the estimate says. Warps are left as tuned
  (they hardly change shared memory). A kernel that fits with no launch (its tiles alone are too
  large: e.g. the float32 backward at K = V = 256) keeps the smallest one and is logged as a
  warning: it will not compile on this GPU, and implementation="xla" is the way there.
  """
  device = device_info() if device is None else device
  opts = DEFAULT.replace(precision=precision)
  problem = operator_problem(r=r, dim_k=dim_k, dim_v=dim_v, dtype=dtype, precision=precision)
  changes = {}
  measured = _measured_on_h200(problem, device)
  for kernel in shared_memory.OPERATOR_KERNELS:
    if kernel in measured:
      continue
    launch = getattr(opts, kernel)
    fitted, size = fit_launch(kernel, launch, problem, device)
    if fitted != launch:
      changes[kernel] = fitted
    if size > device.shared_memory_per_block:
      logging.warning(
        "gdp kernel %s needs about %d KB of shared memory per block for r=%d K=%d V=%d %s; "
        "%s allows %d KB: it will not compile there (use implementation='xla')",
        kernel,
        size // 1024,
        r,
        dim_k,
        dim_v,
        jnp.dtype(dtype).name,
        device.name,
        device.shared_memory_per_block // 1024,
      )
  if changes:
    opts = opts.replace(**changes)
  logging.vlog(
    1,
    "gdp kernel options for r=%d K=%d V=%d %s on %s: %s",
    r,
    dim_k,
    dim_v,
    jnp.dtype(dtype).name,
    device.name,
    opts,
  )
  return opts


_DECODE = tuning.launch("decode")
_STEP = tuning.launch("step")
_PAGED = tuning.launch("paged_decode")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Launch parameters of the grouped-query decode kernel (pallas_kernels/triton/inference).

  resident_per_sm and wave_overhead_blocks are the split count's model
  (decode_splits.default_num_splits), not measurements: the tuned launch (64 rows, 3 stages) takes
  78 KB of shared memory per program (Triton for sm_90), so two run at once on an SM of 227 KB.
  """

  block_s: int = _DECODE["block_s"]
  num_warps: int = _DECODE["num_warps"]
  split_num_warps: int = _DECODE["split_num_warps"]  # when the sequence is split over programs
  num_stages: int = _DECODE["num_stages"]
  min_blocks_per_split: int = _DECODE["min_blocks_per_split"]
  resident_per_sm: int = 2
  wave_overhead_blocks: int = 2


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Launch parameters of the recurrent step kernel (pallas_kernels/triton/inference).

  num_stages has no effect on this kernel (it has no dots,
  so Triton's pipeliner leaves it alone); it is kept for a uniform launch interface.
  """

  block_v: int = _STEP["block_v"]
  num_warps: int = _STEP["num_warps"]
  num_stages: int = _STEP["num_stages"]


@dataclasses.dataclass(frozen=True)
class PagedDecodeOptions:
  """Launch parameters of the paged grouped-query decode kernel (pallas_kernels/triton/inference).

  block_s: cache rows per inner iteration, gathered through the block table (a block may span
  several pages, or a part of one); the other fields as in DecodeOptions. resident_per_sm is
  higher than the dense kernel's: the paged gathers want more programs in flight (on an H200 the
  paged kernel was slower with the dense kernel's split counts at B = 8 and 32,
  benchmarks/results/h200_2026-12-03_decode_one_launch.json).
  """

  block_s: int = _PAGED["block_s"]
  num_warps: int = _PAGED["num_warps"]
  num_stages: int = _PAGED["num_stages"]
  min_blocks_per_split: int = _PAGED["min_blocks_per_split"]
  resident_per_sm: int = 16
  wave_overhead_blocks: int = 2


# The kernels that walk a chunk's r key blocks (chunk_h, chunk_state_output, bwd_dhu: the state
# as r key-block tiles, r x r block products per chunk; bwd_wy: its K pieces) unroll them
# ("blocks"), or run them in a `fori_loop` ("loop": the state kernels hold the state as one
# [K, BV] tile, 2 to 4 products per row block over the whole K), so that the Triton module is one
# block's size (docs/performance.md#compile-time). "auto" loops from this many key blocks on
# (r = 8: 4,200-6,300-line modules with 52-96 dots unrolled).
LOOP_KEY_BLOCKS = 8
LOOP_FORMS = ("auto", "blocks", "loop")


def key_block_loop(form: str, key_blocks: int) -> bool:
  """Whether a kernel runs its key blocks in a loop (`LOOP_FORMS`)."""
  if form not in LOOP_FORMS:
    raise ValueError(f"form must be one of {LOOP_FORMS}, got {form!r}")
  return form == "loop" or (form == "auto" and key_blocks >= LOOP_KEY_BLOCKS)


def loop_warps(num_warps: int, looped: bool, dim_k: int, block_v: int) -> int:
  """A state kernel's warps: in the loop form the state and its update are two [K, BV] float32
  tiles live at once, so at least enough warps (up to 8) for them to take 64 registers a
  thread, as `chunk_fwd`'s loop form does for its carried inverse."""
  if not looped:
    return num_warps
  return max(num_warps, min(8, 2 * dim_k * block_v // (32 * 64)))
