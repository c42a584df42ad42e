"""The TMA ring of the warp-specialised walks (`walk_ws.py`, `backward_walk.py`): a producer
warpgroup streams each step's tiles into one of `stages` shared-memory slots, the consumers
release the slot, the producer refills it
(docs/mosaic_gpu.md#the-ring, which says why this is not `plgpu.emit_pipeline_warp_specialized`).

Per slot three barriers: `in_bar`, the step's TMA copies landed (one arrival per copy);
`prep_ready`, the slot prepared in place by the warpgroup off the chain (one arrival); `in_free`,
released by each consumer (`consumers` arrivals). Step `i` uses slot `i % stages`; a consumer
waits `in_bar.at[slot]` (and `prep_ready`), reads, then arrives on `in_free.at[slot]`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu.common import when

# put(src, dst, part=None): copy `src` into the slot's `dst` (its rows `part`) on the slot's barrier
Put = Callable[..., None]


def barriers(stages: int, copies: int, consumers: int = 2) -> dict:
  """The ring's barriers, scratch of a kernel: `in_bar` (`copies` TMA copies a step),
  `prep_ready` and `in_free` (`consumers` releases), one each per slot (module docstring)."""
  return dict(
    in_bar=plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
    prep_ready=plgpu.Barrier(num_barriers=stages),
    in_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
  )


def _put(loaded, slot, src, dst, part=None) -> None:
  dst = dst.at[slot] if part is None else dst.at[slot].at[part]
  plgpu.copy_gmem_to_smem(src, dst, loaded.at[slot])


def produce(fill: Callable[[Any, Put], None], *, stages: int, count, loaded, free) -> None:
  """The producer's loop over `count` steps (an int, or traced: packed sequences). `fill(i, put)`
  issues step i's copies with `put(src, dst, part=None)`, which copies `src` into the slot's
  `dst` (`dst.at[slot]`, or its rows `part`) on `loaded.at[slot]` (as many copies a step as
  `in_bar` expects). The first `stages` steps fill the empty slots; step i waits for its slot's
  release (`free`); at the end the last release of every slot is consumed, so that no barrier is
  left with an arrival pending when the warpgroups exit."""

  def step(i, slot):
    fill(i, functools.partial(_put, loaded, slot))

  for i in range(stages):  # static slots: nothing to wait for yet
    when(i < count, functools.partial(step, i, i))

  @pl.loop(stages, count)
  def _refill(i):
    slot = lax.rem(i, stages)
    plgpu.barrier_wait(free.at[slot])
    step(i, slot)

  for j in range(stages):
    i = count - stages + j
    when(i >= 0, lambda i=i: plgpu.barrier_wait(free.at[i % stages]))
