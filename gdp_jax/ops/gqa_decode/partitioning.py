"""The Pallas GQA decode kernels partitioned under plain `jax.jit`
(docs/sharding.md#under-plain-jaxjit).

`per_device(run, paged)` wraps an implementation of `gqa_decode` (query, key_cache, value_cache,
lengths, scale) or of `paged_gqa_decode` (query, key_pages, value_pages, block_tables, lengths,
scale) so that inputs sharded over the batch and the heads run the kernels per device on their
block (gdp_jax/ops/partitioning.py). Query head h reads cache head h // (Hq / Hkv): the query
heads are the grouped ("v") heads, the cache heads the key heads ("h"). Labels: query and output
[B, Tq, Hq, D] "b-v-"; the dense cache [B, S, Hkv, D] "b-h-"; the page pools
[num_pages, page_size, Hkv, D] "--h-" (pages are shared by the batch: split over the heads only);
block_tables [B, max_pages] "b-"; lengths [B] "b". A scale that is an array is one more
(replicated) operand. The kernels have no derivatives: differentiating gives their own clear
error.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from gdp_jax.ops.partitioning import ShardSpec, per_shard_call

QUERY = "b-v-"
DENSE = ("b-h-", "b-h-", "b")  # key_cache, value_cache, lengths
PAGED = ("--h-", "--h-", "b-", "b")  # key_pages, value_pages, block_tables, lengths


@dataclasses.dataclass(frozen=True)
class _Decode:
  """run(*arrays, scale) as a 1-tuple: scale static (a float) or the last operand."""

  run: object
  scale: float | None

  def __call__(self, *arrays):
    if self.scale is None:
      *arrays, scale = arrays
    else:
      scale = self.scale
    return (self.run(*arrays, scale),)


def partitioned(run, paged, query, *arrays):
  """run(query, *arrays) with arrays = (caches..., [block_tables,] lengths, scale), per device on
  its block of batch rows and heads under `jax.jit` (module docstring)."""
  *arrays, scale = arrays
  operands = (QUERY, *(PAGED if paged else DENSE))
  static = scale if isinstance(scale, (int, float)) else None
  if static is None:
    operands, arrays = (*operands, ""), [*arrays, scale]
  cache_heads = arrays[0].shape[2]
  spec = ShardSpec(
    _Decode(run, static), operands, (QUERY,), heads=cache_heads, group=query.shape[2] // cache_heads
  )
  return per_shard_call(spec, query, *arrays)[0]


def per_device(run, paged: bool):
  """`run` with the same signature, partitioned (`partitioned`); `run` itself in a process with
  one device, where there is nothing to partition (and the Mosaic GPU interpreter's callbacks
  could not pass through custom_partitioning's lowering)."""
  if jax.device_count() == 1:
    return run
  return functools.partial(partitioned, run, paged)
