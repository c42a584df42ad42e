"""The shared-memory estimate of the Pallas kernels (pallas_kernels/common/shared_memory.py) and
the launch heuristic built on it (options.heuristic_options): pure Python, no kernel runs.

The estimate is checked against Triton's own figures (TRITON_3_9), the heuristic against a table
of GPUs for every configuration of the GPU test matrix (scripts/gpu_matrix.py), and the H200
defaults of the benchmark shape are pinned.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax.numpy as jnp
import pytest

from pallas_kernels.common import options
from pallas_kernels.common import shared_memory as sm
from pallas_kernels.common.device import SHARED_MEMORY_PER_BLOCK, DeviceInfo

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import gpu_matrix  # noqa: E402

KB = 1024
# Opt-in shared memory per thread block, from NVIDIA's CUDA C++ Programming Guide, table
# "Technical Specifications per Compute Capability" (maximum shared memory per thread block):
# 7.5: 64 KB, 8.0: 163 KB, 8.6 and 8.9: 99 KB, 9.0: 227 KB, 10.0: 227 KB, 12.0: 99 KB. Triton's
# "out of resource: shared memory" errors print the same limits as "Hardware limit": 65536 on a
# T4 (vllm-project/vllm issue 36802), 101376 = 99 KB on RTX 3090 / 4090 class cards
# (triton-lang/triton issue 8182), 232448 = 227 KB on Hopper / Blackwell data-center GPUs
# (triton-lang/triton pull request 8773).
DEVICES = {
  "Tesla T4": ((7, 5), 64 * KB),
  "NVIDIA A100": ((8, 0), 163 * KB),
  "NVIDIA L4": ((8, 9), 99 * KB),
  "NVIDIA GeForce RTX 4090": ((8, 9), 99 * KB),
  "NVIDIA H100": ((9, 0), 227 * KB),
  "NVIDIA H200": ((9, 0), 227 * KB),
  "NVIDIA B200": ((10, 0), 227 * KB),
  "NVIDIA GeForce RTX 5090": ((12, 0), 99 * KB),
}
H200 = DeviceInfo(
  platform="gpu", name="NVIDIA H200", compute_capability=(9, 0), shared_memory_per_block=227 * KB
)


def _device(name):
  capability, smem = DEVICES[name]
  return DeviceInfo(
    platform="gpu", name=name, compute_capability=capability, shared_memory_per_block=smem
  )


# Every (dtype, K, V, r, float32 precision) of the GPU test matrix (its default plan; the mask
# shape does not change the tiles).
_PLAN = argparse.Namespace(
  tiny=False,
  rs="1,2,4,8",
  dtype="bf16,f16,f32",
  precisions="ieee,tf32",
  dims=gpu_matrix.DIMS,
  masks="shared",
  only=None,
  shard="0/1",
)
MATRIX = sorted({(c.dtype, c.K, c.V, c.r, c.precision or "tf32") for c in gpu_matrix.plan(_PLAN)})

# Kernels whose tiles alone exceed an H200's 227 KB by the estimate, whatever the launch: none of
# the kernels that ship (the five-kernel forward's kkt did at float32, K = 256, r = 8; removed,
# docs/performance.md#variants-removed). The backward's bwd_wy and bwd_dqkwg walk K and V in
# pieces and fit everywhere in the matrix.
H200_TOO_LARGE: dict[str, set[tuple]] = {}
# ... of which these only at precision="ieee" (none now).
H200_TOO_LARGE_IEEE_ONLY: set[tuple] = set()


def test_device_table_matches_device_info():
  # device_info reads the limit from the compute capability
  for capability, smem in DEVICES.values():
    assert SHARED_MEMORY_PER_BLOCK[capability] == smem


def test_matrix_is_the_gpu_matrix():
  assert len(MATRIX) == 10 * 4 * 4  # (K, V) pairs x r x (bf16, f16, f32 ieee, f32 tf32)


def _fits_or_cannot(opts, dtype, K, V, r, device):
  """{kernel: bytes} of the kernels over the device's limit with `opts`, after checking that none
  of them had a launch that fits (the heuristic took the smallest)."""
  over = options.over_budget(opts, r=r, dim_k=K, dim_v=V, dtype=dtype, device=device)
  problem = options.operator_problem(r=r, dim_k=K, dim_v=V, dtype=dtype, precision=opts.precision)
  for kernel in over:
    smallest = min(
      sm.estimate_bytes(
        kernel,
        problem,
        num_stages=c.num_stages,
        num_warps=c.num_warps,
        block=c.block_v,
        block_k=c.block_k,
        wgmma=sm.has_wgmma(device),
      )
      for c in options._candidates(getattr(options.DEFAULT, kernel), problem.dim_v)
    )
    assert smallest > device.shared_memory_per_block, (kernel, dtype, K, V, r, device.name)
  return over


@pytest.mark.parametrize("name", list(DEVICES))
def test_heuristic_never_exceeds_a_device_where_a_launch_fits(name):
  device = _device(name)
  too_large = 0
  for dt, K, V, r, precision in MATRIX:
    dtype = gpu_matrix.DTYPES[dt]
    opts = options.heuristic_options(
      r=r, dim_k=K, dim_v=V, dtype=dtype, precision=precision, device=device
    )
    too_large += len(_fits_or_cannot(opts, dtype, K, V, r, device))
  if DEVICES[name][1] >= 227 * KB:
    assert too_large == 0  # every kernel of every matrix shape fits on an H100 / H200 / B200
  else:
    assert too_large  # the smaller GPUs: the float32 backward at large K and V fits nowhere


def test_h200_too_large_is_exactly_the_list():
  found = set()
  for dt, K, V, r, precision in MATRIX:
    dtype = gpu_matrix.DTYPES[dt]
    opts = options.heuristic_options(
      r=r, dim_k=K, dim_v=V, dtype=dtype, precision=precision, device=H200
    )
    for kernel in _fits_or_cannot(opts, dtype, K, V, r, H200):
      found.add((kernel, dt, K, V, r, precision))
  expected = {
    (kernel, *cfg, precision)
    for kernel, cfgs in H200_TOO_LARGE.items()
    for cfg in cfgs
    for precision in (("ieee", "tf32") if cfg[0] == "f32" else ("tf32",))
  }
  expected -= {(*key, "tf32") for key in H200_TOO_LARGE_IEEE_ONLY}
  assert found == expected


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_h200_keeps_the_tuned_defaults_for_half_precision(dtype, r):
  opts = options.heuristic_options(r=r, dim_k=128, dim_v=128, dtype=dtype, device=H200)
  assert opts == options.DEFAULT
  assert not options.over_budget(opts, r=r, dim_k=128, dim_v=128, dtype=dtype, device=H200)


@pytest.mark.parametrize(
  "r,changed",
  [
    # measured on an H200: the backward compiles with the defaults at
    # r = 1, 2, 4; the fused state/output kernel was never run in float32 there, and Triton 3.9
    # puts it at 338 KB (r = 1) and 185 KB (r = 2) with 3 stages
    (1, {"chunk_state_output": options.Launch(num_warps=4, num_stages=1, block_v=64)}),
    (2, {"chunk_state_output": options.Launch(num_warps=4, num_stages=2, block_v=64)}),
    (4, {}),
    (
      8,
      {
        "chunk_state_output": options.Launch(num_warps=4, num_stages=2, block_v=64),
        "chunk_h": options.Launch(num_warps=4, num_stages=2, block_v=64),
        "bwd_wy": options.Launch(num_warps=4, num_stages=2, block_v=64, block_k=64),
      },
    ),
  ],
)
def test_h200_float32_defaults(r, changed):
  opts = options.heuristic_options(r=r, dim_k=128, dim_v=128, dtype=jnp.float32, device=H200)
  assert opts == options.DEFAULT.replace(**changed)


def test_smaller_gpus_get_smaller_launches():
  kw = dict(r=1, dim_k=128, dim_v=128, dtype=jnp.bfloat16)
  big = options.heuristic_options(**kw, device=H200)
  for name in ("NVIDIA L4", "NVIDIA GeForce RTX 5090", "NVIDIA A100"):
    small = options.heuristic_options(**kw, device=_device(name))
    assert small.chunk_state_output != big.chunk_state_output
    # bf16 at the benchmark shape fits the 99 KB GPUs whole (mma.sync staging, no wgmma buffer)
    assert not options.over_budget(small, **kw, device=_device(name))


# Shared memory Triton 3.9 allocates (its `metadata.shared`) for the kernels' lowered Triton IR,
# compiled on a CPU for sm_90 or sm_80 with the given warps and stages:
# (kernel, dtype, precision, sm, r, K, V, chunk, warps, stages, block_v, bytes).
TRITON_3_9 = [
  ("chunk_fwd", "bf16", "tf32", 90, 1, 128, 128, 64, 2, 1, None, 8192),
  ("chunk_state_output", "bf16", "tf32", 90, 1, 128, 128, 64, 4, 3, 64, 174080),
  ("wy", "bf16", "tf32", 90, 1, 128, 128, 64, 4, 2, None, 24576),
  ("chunk_h", "bf16", "tf32", 90, 1, 128, 128, 64, 4, 3, 64, 123904),
  ("bwd_dv_local", "bf16", "tf32", 90, 1, 128, 128, 64, 4, 2, None, 49152),
  ("bwd_dhu", "bf16", "tf32", 90, 1, 128, 128, 64, 4, 2, 64, 115200),
  # bwd_dqkwg, bwd_wy with their default K pieces (BLOCK_K) and V pieces of 64
  ("bwd_dqkwg", "bf16", "tf32", 90, 1, 128, 128, 64, 8, 2, 64, 65568),
  ("bwd_dqkwg", "bf16", "tf32", 90, 2, 128, 128, 32, 8, 2, 64, 40992),
  ("bwd_dqkwg", "bf16", "tf32", 90, 4, 128, 128, 16, 8, 2, 64, 28704),
  ("bwd_wy", "bf16", "tf32", 90, 1, 128, 128, 64, 8, 2, 64, 32768),
  ("bwd_wy", "bf16", "tf32", 90, 2, 128, 128, 32, 8, 2, 64, 24576),
  ("bwd_wy", "bf16", "tf32", 90, 4, 128, 128, 16, 8, 2, 64, 24576),
  ("bwd_wy", "bf16", "tf32", 90, 8, 128, 128, 16, 8, 2, 64, 69632),
  ("bwd_dqkwg", "f32", "tf32", 90, 1, 128, 128, 64, 8, 2, 64, 131104),
  ("bwd_dqkwg", "f32", "tf32", 90, 2, 128, 128, 32, 8, 2, 64, 81952),
  ("bwd_dqkwg", "f32", "tf32", 90, 4, 128, 128, 16, 8, 2, 64, 57376),
  ("bwd_dqkwg", "f32", "tf32", 90, 8, 128, 128, 16, 8, 2, 64, 81952),
  ("bwd_wy", "f32", "tf32", 90, 1, 128, 128, 64, 8, 2, 64, 65536),
  ("bwd_wy", "f32", "tf32", 90, 2, 128, 128, 32, 8, 2, 64, 57344),
  ("bwd_wy", "f32", "tf32", 90, 4, 128, 128, 16, 8, 2, 64, 53248),
  ("bwd_wy", "f32", "tf32", 90, 8, 128, 128, 16, 8, 2, 64, 139264),
  ("bwd_dqkwg", "f32", "ieee", 90, 1, 128, 128, 64, 8, 2, 64, 81952),
  ("bwd_wy", "f32", "ieee", 90, 1, 128, 128, 64, 8, 2, 64, 49152),
  ("bwd_dqkwg", "bf16", "tf32", 80, 1, 128, 128, 64, 8, 2, 64, 40992),
  ("bwd_dqkwg", "f32", "tf32", 80, 1, 128, 128, 64, 8, 2, 64, 81952),
  ("bwd_wy", "f32", "tf32", 90, 1, 256, 256, 64, 8, 2, 64, 65536),
  ("bwd_dqkwg", "f32", "tf32", 90, 1, 256, 256, 64, 8, 2, 64, 131104),
  ("bwd_wy", "bf16", "tf32", 90, 8, 256, 256, 16, 8, 2, 64, 73728),
  ("bwd_dqkwg", "bf16", "tf32", 90, 1, 256, 256, 64, 8, 2, 64, 65568),
  ("chunk_fwd", "bf16", "tf32", 90, 2, 128, 128, 32, 2, 1, None, 8192),
  ("chunk_state_output", "bf16", "tf32", 90, 2, 128, 128, 32, 4, 3, 64, 99328),
  ("wy", "bf16", "tf32", 90, 2, 128, 128, 32, 4, 2, None, 24576),
  ("chunk_h", "bf16", "tf32", 90, 2, 128, 128, 32, 4, 3, 64, 78336),
  ("bwd_dv_local", "bf16", "tf32", 90, 2, 128, 128, 32, 4, 2, None, 16384),
  ("bwd_dhu", "bf16", "tf32", 90, 2, 128, 128, 32, 4, 2, 64, 78080),
  ("chunk_fwd", "bf16", "tf32", 90, 4, 128, 128, 16, 2, 1, None, 8192),
  ("chunk_state_output", "bf16", "tf32", 90, 4, 128, 128, 16, 4, 3, 64, 68096),
  ("wy", "bf16", "tf32", 90, 4, 128, 128, 16, 4, 2, None, 24576),
  ("chunk_h", "bf16", "tf32", 90, 4, 128, 128, 16, 4, 3, 64, 59648),
  ("bwd_dv_local", "bf16", "tf32", 90, 4, 128, 128, 16, 4, 2, None, 8192),
  ("bwd_dhu", "bf16", "tf32", 90, 4, 128, 128, 16, 4, 2, 64, 24704),
  ("chunk_state_output", "f32", "tf32", 90, 1, 128, 128, 64, 4, 3, 64, 346112),
  ("chunk_state_output", "f32", "tf32", 90, 2, 128, 128, 32, 4, 3, 64, 189440),
  ("chunk_state_output", "f32", "tf32", 90, 4, 128, 128, 16, 4, 3, 64, 135680),
  ("chunk_state_output", "f32", "tf32", 90, 8, 128, 128, 16, 4, 3, 64, 233984),
  ("bwd_dhu", "f32", "tf32", 90, 1, 128, 128, 64, 4, 2, 64, 246272),
  ("bwd_dhu", "f32", "tf32", 90, 2, 128, 128, 32, 4, 2, 64, 155904),
  ("bwd_dhu", "f32", "tf32", 90, 4, 128, 128, 16, 4, 2, 64, 73856),
  ("bwd_dhu", "f32", "tf32", 90, 8, 128, 128, 16, 4, 2, 64, 123008),
  ("chunk_h", "f32", "tf32", 90, 1, 128, 128, 64, 4, 3, 64, 246784),
  ("chunk_h", "f32", "tf32", 90, 2, 128, 128, 32, 4, 3, 64, 156160),
  ("chunk_h", "f32", "tf32", 90, 4, 128, 128, 16, 4, 3, 64, 119040),
  ("bwd_dhu", "f32", "ieee", 90, 1, 128, 128, 64, 4, 2, 64, 164352),
  ("chunk_h", "f32", "ieee", 90, 1, 128, 128, 64, 4, 3, 64, 197632),
  ("wy", "f32", "ieee", 90, 1, 128, 128, 64, 4, 2, None, 49152),
  ("bwd_dv_local", "f32", "ieee", 90, 1, 128, 128, 64, 4, 2, None, 98304),
  ("wy", "f32", "ieee", 90, 1, 256, 256, 64, 4, 2, None, 81920),
  ("chunk_h", "f32", "ieee", 90, 1, 256, 256, 64, 4, 3, 64, 361472),
  ("chunk_state_output", "bf16", "tf32", 80, 1, 128, 128, 64, 4, 3, 64, 133120),
  ("chunk_h", "bf16", "tf32", 80, 1, 128, 128, 64, 4, 3, 64, 99328),
  ("bwd_dhu", "bf16", "tf32", 80, 1, 128, 128, 64, 4, 2, 64, 57856),
  ("chunk_state_output", "f32", "tf32", 80, 1, 128, 128, 64, 4, 3, 64, 264192),
  ("chunk_h", "f32", "tf32", 80, 1, 128, 128, 64, 4, 3, 64, 197632),
  ("bwd_dhu", "f32", "tf32", 80, 1, 128, 128, 64, 4, 2, 64, 164352),
]
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
# the K piece (Launch.block_k) the rows of the kernels that walk K were measured with
BLOCK_K = {"bwd_dqkwg": 64, "bwd_wy": 32}


@pytest.mark.parametrize("row", TRITON_3_9, ids=lambda row: "-".join(map(str, row[:8])))
def test_estimate_is_never_below_triton(row):
  kernel, dt, precision, cc, r, K, V, chunk, warps, stages, block_v, measured = row
  problem = sm.Problem(r=r, dim_k=K, dim_v=V, chunk=chunk, dtype=DTYPES[dt], precision=precision)
  tiles = sm.tiles(kernel, problem, block=block_v, block_k=BLOCK_K.get(kernel))
  assert tiles.bytes(stages, warps, wgmma=cc == 90) >= measured
  # and not absurdly above it where the tiles are large
  if measured >= 64 * KB:
    assert tiles.bytes(stages, warps, wgmma=cc == 90) <= 3 * measured


def test_estimate_covers_the_h200_failure():
  # jaxlib's Triton asked 311 KB for the float32 IEEE backward at K = V = 128, r = 1 on an H200,
  # when bwd_dqkwg took all of K and V in one program: its estimate at that shape covers it
  problem = sm.Problem(r=1, dim_k=128, dim_v=128, chunk=64, dtype=jnp.float32, precision="ieee")
  whole = dict(block=None, block_k=None)
  assert sm.estimate_bytes("bwd_dqkwg", problem, num_stages=2, num_warps=8, **whole) >= 311 * KB


def test_every_kernel_has_an_estimate_and_bad_names_are_errors():
  problem = sm.Problem(r=2, dim_k=64, dim_v=64, chunk=32, dtype=jnp.bfloat16)
  for kernel in sm.KERNELS:
    assert sm.tiles(kernel, problem, block=64).bytes(2) > 0
  with pytest.raises(ValueError, match="kernel must be one of"):
    sm.tiles("chunk_x", problem)
  with pytest.raises(ValueError, match="divide dim_k"):
    sm.tiles("wy", sm.Problem(r=3, dim_k=64, dim_v=64, chunk=16, dtype=jnp.bfloat16))
  decode = sm.shared_memory_bytes(
    "gqa_decode", options.DecodeOptions(), r=1, dim_k=128, dim_v=128, chunk=4, dtype=jnp.bfloat16
  )
  step = sm.shared_memory_bytes(
    "recurrent_step", options.StepOptions(), r=2, dim_k=128, dim_v=128, chunk=1, dtype=jnp.bfloat16
  )
  assert decode <= 99 * KB and step <= 64 * KB


def test_more_stages_and_wider_tiles_never_need_less():
  problem = sm.Problem(r=2, dim_k=128, dim_v=128, chunk=32, dtype=jnp.float32)
  for kernel in ("chunk_state_output", "chunk_h", "bwd_dhu"):
    sizes = [
      sm.estimate_bytes(kernel, problem, num_stages=s, block=bv)
      for bv in (16, 32, 64)
      for s in (1, 2, 3)
    ]
    assert sizes == sorted(sizes) or all(
      sm.estimate_bytes(kernel, problem, num_stages=s, block=bv)
      <= sm.estimate_bytes(kernel, problem, num_stages=s + 1, block=2 * bv)
      for bv in (16, 32)
      for s in (1, 2)
    )
