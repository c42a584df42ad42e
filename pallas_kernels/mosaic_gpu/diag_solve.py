"""The 16-row diagonal blocks of `T0 = (I + A0)^-1`, solved in float32 on the CUDA cores
(docs/mosaic_gpu.md#the-float32-solve-of-the-16-row-groups has the math).

Replaces `chunk_inverse`'s tensor-core merges of the groups up to 16 rows with forward
substitution, a thread per column, right-looking (one fused multiply-add per row on the dependent
chain); `within_token` also couples a token's sub-steps (the Householder form). Raw Mosaic GPU
(`plgpu.inline_mgpu`: Pallas has no per-thread code), which the Mosaic GPU interpreter does not
run: interpreted, `chunk_inverse` merges the small groups instead, and the GPU check
(benchmarks/mosaic_gpu_check.py) tests this solve compiled against the jnp implementation.
"""

from __future__ import annotations

import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref
from jaxlib.mlir.dialects import math as mlir_math

from pallas_kernels.mosaic_gpu.common import F32, ROWS_PER_CHUNK, chunk_tokens

N = ROWS_PER_CHUNK
BLOCK_ROWS = 16
PAD = 8  # float32 words of padding per row of the solve's buffers (bank conflicts, above)


def scratch() -> list:
  """The solve's two float32 buffers: A0 as the threads read it, and X as they write it."""
  return [plgpu.SMEM((N, N + PAD), F32) for _ in range(2)]


def diag_block_inverse(a0, bufs, r: int, within_token: bool = False):
  """`X = (I + A0_16)^-1` as float32 WGMMA-layout registers `[N, N]`, with `A0_16` the part of
  `a0` (float32 `[N, N]` registers, strictly lower in token order, or with `within_token` in
  sub-step order) inside the 16-row groups; zero outside those blocks. `bufs`: `scratch()`."""
  c = chunk_tokens(r)
  group = BLOCK_ROWS // r  # tokens per 16-row group

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((N, N), F32, layout=plgpu.Layout.WGMMA),
  )
  def solve(ctx, a0_regs, a_ref, x_ref):
    del ctx
    f32 = ir.F32Type.get()
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    const = mgpu_utils.c
    a0_regs.store_untiled(a_ref, optimized=False)
    zeros = mgpu.FragmentedArray.splat(const(0.0, f32), (N, N), layout=mgpu.WGMMA_LAYOUT)
    zeros.store_untiled(x_ref, optimized=False)
    mgpu_utils.warpgroup_barrier()  # A0 and the zeros are visible to every thread
    tid = arith.remui(mgpu_utils.thread_idx(), const(128, i32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, const(N, i32))):
      col = arith.index_cast(index, tid)  # column (a0, t0) of X this thread solves
      t0 = arith.remui(tid, const(c, i32))
      a0_blk = arith.divui(tid, const(c, i32))
      local0 = arith.remui(t0, const(group, i32))  # t0's place in its group
      first = arith.index_cast(index, arith.subi(t0, local0))  # the group's first token

      def row(a: int, local: int):
        return arith.addi(first, const(a * c + local, index))

      def is_start(a: int, local: int):
        same_block = arith.cmpi(arith.CmpIPredicate.eq, a0_blk, const(a, i32))
        same_token = arith.cmpi(arith.CmpIPredicate.eq, local0, const(local, i32))
        return arith.andi(same_block, same_token)

      one, zero = const(1.0, f32), const(0.0, f32)
      rest = {
        (a, t): arith.select(is_start(a, t), one, zero) for a in range(r) for t in range(group)
      }
      for s in range(group):  # tokens in order
        for d in range(r):
          x_ds = rest.pop((d, s))
          memref.store(x_ds, x_ref, [row(d, s), col])
          later = [(a, t) for a in range(r) for t in range(s + 1, group)]
          if within_token:  # and the token's later sub-steps
            later += [(a, s) for a in range(d + 1, r)]
          for a, t in later:
            a_entry = memref.load(a_ref, [row(a, t), row(d, s)])
            rest[(a, t)] = mlir_math.fma(arith.negf(a_entry), x_ds, rest[(a, t)])
    mgpu_utils.warpgroup_barrier()  # every column is written before X is read back
    return mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)

  a_buf, x_buf = bufs
  return solve(a0, a_buf.at[:, :N], x_buf.at[:, :N])
