"""The fused Mosaic GPU forward (pallas_kernels/mosaic_gpu/fused_forward.py) on a CPU.

Lowered for cuda at the benchmark shape (one kernel, its shared memory within the H200's), and run
in the Mosaic GPU interpreter at small shapes against the reference and the two-kernel forward
(`chunk_inverse` then `state_walk_ws`), in a subprocess with NPROC=8: the interpreter runs the four
warpgroups as threads of XLA's CPU pool (docs/mosaic_gpu.md#testing-without-a-gpu). One case runs
in the fast tier, the rest in the slow one. Compiled on an H200: benchmarks/mosaic_fused_forward.py.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest

from pallas_kernels.mosaic_gpu import common, fused_forward
from pallas_kernels.mosaic_gpu.forward import forward
from tests.test_mosaic_gpu import _inputs, _reference, _rel_rms

F32 = jnp.float32


@pytest.mark.parametrize(
  "r,mask_kind",
  [
    (1, "none"),
    pytest.param(2, "token", marks=pytest.mark.slow),
    pytest.param(4, "head", marks=pytest.mark.slow),
  ],
)
def test_fused_forward_lowers_for_cuda_at_benchmark_shape(r, mask_kind):
  batch, t_len, heads, dim = 8, 4096, 16, 128
  spec = jax.ShapeDtypeStruct
  act = spec((batch, t_len, heads, dim), jnp.bfloat16)
  gate = spec((batch, t_len, heads), F32)
  shapes = {"none": None, "head": (heads, r, r), "token": (batch, t_len, heads, r, r)}
  mask = None if shapes[mask_kind] is None else spec(shapes[mask_kind], F32)
  h0 = spec((batch, heads, dim, dim), F32)

  def run(q, k, v, g, beta, mask, h0):
    return forward(q, k, v, g, beta, mask, initial_state=h0, output_final_state=True, fused=True)

  lowered = jax.jit(run).trace(act, act, act, gate, gate, mask, h0)
  text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
  assert len(calls) == 1, calls  # one kernel: no chunk_inverse launch, no T0 in memory
  # two ring stages fit in the H200's 227 KB with the margin the walks keep; three do not
  need = functools.partial(fused_forward.smem_bytes, dim, 64, r, jnp.bfloat16, staged=False)
  assert need(stages=2) + common.SMEM_MARGIN <= common.SMEM_LIMIT
  assert common.ring_stages("fused", lambda n: need(stages=n)) == 2


def test_fused_forward_refuses_what_it_cannot_take():
  q, k, v, g, beta, _, _ = _inputs(0, 1, 64, 1, 64, 64, 1, "none")
  with pytest.raises(ValueError, match="store_states"):
    forward(q, k, v, g, beta, fused=True, store_states=True)
  with pytest.raises(ValueError, match="Householder"):
    fused_forward.fused_walk(q, k[:, :, None], v[:, :, None], *(jnp.zeros((1, 1, 64), F32),) * 3,
                             jnp.ones((1, 1, 1, 1, 64), F32), jnp.ones((4,), F32))  # fmt: skip
  with pytest.raises(ValueError, match="interpreter"):
    fused_forward.fused_walk(
      q, k, v, *(jnp.zeros((1, 1, 64), F32),) * 3, jnp.ones((1, 1, 1, 1, 64), F32),
      jnp.ones((4,), F32), diag_solve=True, interpret=plgpu.InterpretGPUParams(),
    )  # fmt: skip


# (r, mask kind, T, dtype, initial/final state)
FAST_CASE = (2, "token", 45, "bfloat16", True)
SLOW_CASES = [
  (1, "token", 70, "bfloat16", True),
  (4, "head", 33, "float16", True),
  (2, "shared", 64, "bfloat16", False),
  (1, "none", 150, "bfloat16", False),
]
# the inverses split over two warpgroups: three chunks, one left to each warpgroup, and one;
# the inputs of a slow case, whose two-kernel forward and reference results it shares
SPLIT_CASE = (4, "head", 33, "float16", True)


def _name(case):
  return "-".join(str(x) for x in case)


def _references(case):
  """A case's inputs and what the fused forward is held to: the two-kernel forward (interpreted)
  and the reference (the operator's recurrence), and the reference with the mask transposed (what
  a wrong mask orientation scores)."""
  r, mask_kind, t_len, dtype, state = case
  q, k, v, g, beta, mask, h0 = _inputs(7 + r, 1, t_len, 2, 64, 64, r, mask_kind, jnp.dtype(dtype))
  h0 = h0 if state else None
  params = plgpu.InterpretGPUParams(detect_races=True)
  run = functools.partial(forward, scale=0.3, output_final_state=state, interpret=params)
  inputs = (q, k, v, g, beta, mask, h0)
  two = jax.jit(run)(q, k, v, g, beta, mask, initial_state=h0)
  wrong = None
  if mask is not None and r > 1:
    wrong = _reference(q, k, v, g, beta, jnp.swapaxes(mask, -1, -2), h0, scale=0.3)[0]
  return inputs, two, _reference(q, k, v, g, beta, mask, h0, scale=0.3), wrong


def _run_case(case, references, split=False):
  """The fused forward against the reference and the two-kernel forward, in the interpreter;
  `split`: the inverses shared by two warpgroups (`split_inverse`)."""
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

  from pallas_kernels.mosaic_gpu import forward as forward_mod

  if split:
    forward_mod.fused_walk = functools.partial(fused_forward.fused_walk, split_inverse=True)
  state = case[-1]
  (q, k, v, g, beta, mask, h0), (o2, final2), (want_o, want_final), wrong_o = references
  params = plgpu.InterpretGPUParams(detect_races=True)
  run = functools.partial(
    forward, scale=0.3, output_final_state=state, interpret=params, fused=True
  )
  o, final = jax.jit(run)(q, k, v, g, beta, mask, initial_state=h0)
  row = dict(
    o=_rel_rms(o.astype(F32), want_o),
    o_two=_rel_rms(o.astype(F32), o2.astype(F32)),
    shape_ok=o.shape == v.shape and o.dtype == q.dtype,
    races=bool(get_races().races_found),
  )
  if state:
    row["state"] = _rel_rms(final, want_final)
    row["state_two"] = _rel_rms(final, final2)
  if wrong_o is not None:
    row["o_wrong"] = _rel_rms(o.astype(F32), wrong_o)
  return row


def _guard_case():
  """The operator without gradient (the fused kernel, its guard inside) on inputs with a nan key
  (head 0 from token 20), an inf query (head 1, its token 10 only) and a -inf value (head 1 from
  token 30), against "xla": the same nan pattern, the same values elsewhere."""
  import numpy as np

  import gdp_jax

  q, k, v, g, beta, mask, h0 = _inputs(3, 1, 45, 2, 64, 64, 2, "token")
  q = q.at[0, 10, 1, 5].set(jnp.inf)
  k = k.at[0, 20, 0, 3].set(jnp.nan)
  v = v.at[0, 30, 1, 40].set(-jnp.inf)
  run = lambda impl, *a: gdp_jax.gated_delta_product(
    *a, initial_state=h0, output_final_state=True, scale=0.3, implementation=impl
  )
  o, final = jax.jit(functools.partial(run, "mosaic_gpu"))(q, k, v, g, beta, mask)
  up = lambda x: x.astype(F32)
  want_o, want_final = jax.jit(functools.partial(run, "xla"))(up(q), up(k), up(v), g, beta, mask)
  o, want_o = np.asarray(up(o)), np.asarray(want_o)
  fine = ~np.isnan(want_o)
  return dict(
    same_nan=bool((np.isnan(o) == ~fine).all()),
    same_final_nan=bool((np.isnan(final) == np.isnan(want_final)).all()),
    some_nan=bool((~fine).any() and np.isnan(want_final).any() and fine.any()),
    o=_rel_rms(np.where(fine, o, 0.0), np.where(fine, want_o, 0.0)),
  )


def _interpreted(tier: str) -> dict:
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, NPROC="8", PYTHONPATH=str(root))
  run = subprocess.run(
    [sys.executable, __file__, "--interpreted", tier],
    cwd=root, env=env, capture_output=True, text=True, timeout=540,
  )  # fmt: skip
  lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
  assert run.returncode == 0 and lines, run.stderr[-4000:]
  return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def interpreted(request):
  """The interpreted cases, in one subprocess: the fast tier's case alone when no slow test of
  this file runs (make test-fast), every case otherwise."""
  slow = any(
    item.module is request.module and item.get_closest_marker("slow")
    for item in request.session.items
  )
  return _interpreted("all" if slow else "fast")


def _check(row):
  assert row["shape_ok"] and not row["races"], row
  assert row["o"] < 1e-2 and row.get("state", 0.0) < 1e-2, row
  # the two forwards differ only in roundings of T0 and Ag (T0 never rounded to 16 bits here)
  assert row["o_two"] < 1e-2 and row.get("state_two", 0.0) < 1e-2, row
  if "o_wrong" in row:  # the check can fail
    assert row["o_wrong"] > 2e-2, row


def test_fused_forward_interpreted_matches_the_reference_and_two_kernels(interpreted):
  _check(interpreted[_name(FAST_CASE)])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_name)
def test_fused_forward_interpreted_cases(interpreted, case):
  _check(interpreted[_name(case)])


@pytest.mark.slow
def test_the_inverses_split_over_two_warpgroups(interpreted):
  _check(interpreted["split"])


@pytest.mark.slow
def test_the_guard_inside_the_fused_kernel_matches_xla(interpreted):
  row = interpreted["guard"]
  assert row["some_nan"] and row["same_nan"] and row["same_final_nan"], row
  assert row["o"] < 1e-2, row


if __name__ == "__main__" and "--interpreted" in sys.argv:
  cases = [FAST_CASE] + (SLOW_CASES if sys.argv[-1] == "all" else [])
  references = {case: _references(case) for case in cases}
  result = {_name(case): _run_case(case, references[case]) for case in cases}
  if sys.argv[-1] == "all":
    result["guard"] = _guard_case()
    result["split"] = _run_case(SPLIT_CASE, references[SPLIT_CASE], split=True)
  print("RESULT " + json.dumps(result))
