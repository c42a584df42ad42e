"""One kernel alone per jitted function, for compile_profile.py's `kernels` entry: each Mosaic GPU
kernel of the operator's training step on the inputs the operator gives it at the benchmark
shape, the whole operator for comparison, and the models' flash attention
(docs/performance.md#compile-time).

`case(name, r, shape)` returns (function, argument ShapeDtypeStructs): the function holds exactly
one kernel call (the operator cases and the attention's backward apart), its arguments are what
the kernel reads, prepared as pallas_kernels/mosaic_gpu/forward.py's `prepare` does and shaped by
the kernels before it (`jax.eval_shape`). `profile` times one case's stages (and, compiled, two
calls on zeros); `kernel_cases` names the cases of an r list.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

# The kernels of a training step, the operator (forward; value_and_grad of a
# loss reading o) and the models' flash attention (forward; forward and backward).
KERNELS = ("chunk_inverse", "state_walk_ws", "state_grad_walk", "chunk_grads")
OPERATOR = ("operator-fwd", "operator-fwdbwd")
ATTENTION = ("flash_attention-fwd", "flash_attention-fwdbwd")
# The attention layers of train-lm's h200 preset (examples/byte_lm/train_lm.py): B, T, Hq, Hkv, D.
ATTENTION_SHAPE = (8, 4096, 12, 4, 64)
F32 = jnp.float32


def _inputs(r, shape):
  """The operator's arguments (q, k, v, g, beta, mask [r, r]) as ShapeDtypeStructs."""
  spec = jax.ShapeDtypeStruct
  batch, t_len, heads, key_dim, value_dim = shape
  qk = spec((batch, t_len, heads, key_dim), jnp.bfloat16)
  gate = spec((batch, t_len, heads), F32)
  v = spec((batch, t_len, heads, value_dim), jnp.bfloat16)
  return qk, qk, v, gate, spec((batch, t_len, heads), jnp.bfloat16), spec((r, r), F32)


def _prepared(q, k, v, g, beta, mask):
  """prepare's operands, in the order the walks take them."""
  from pallas_kernels.mosaic_gpu.forward import prepare

  ops = prepare(q, k, v, g, beta, mask, None)
  return ops.q, ops.k, ops.v, ops.gamma, ops.gamma_rows, ops.beta_rows, ops.mask_rows, ops.scale


def _operator_case(name, r, shape):
  from gdp_jax import gated_delta_product

  def forward(q, k, v, g, beta, mask):
    return gated_delta_product(q, k, v, g, beta, mask, implementation="mosaic_gpu")[0]

  if name == "operator-fwd":
    return forward, _inputs(r, shape)

  def step(*args):
    loss = lambda *a: jnp.sum(forward(*a).astype(F32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(*args)

  return step, _inputs(r, shape)


def _attention_case(name):
  from gdp_jax.layers.attention import _flash_attention_kernels

  spec = jax.ShapeDtypeStruct
  batch, t_len, heads, kv_heads, dim = ATTENTION_SHAPE
  args = (
    spec((batch, t_len, heads, dim), jnp.bfloat16),
    spec((batch, t_len, kv_heads, dim), jnp.bfloat16),
    spec((batch, t_len, kv_heads, dim), jnp.bfloat16),
    spec((batch, t_len), jnp.int32),  # segment ids, as train-lm passes
  )
  if name == "flash_attention-fwd":
    return _flash_attention_kernels, args

  def step(q, k, v, segment_ids):
    loss = lambda q, k, v: jnp.sum(_flash_attention_kernels(q, k, v, segment_ids).astype(F32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  return step, args


def case(name, r, shape):
  """(function, argument ShapeDtypeStructs) of case `name` at r key blocks and shape B, T, H, K,
  V (the attention's at ATTENTION_SHAPE)."""
  from pallas_kernels.mosaic_gpu import backward_walk, chunk_grads, chunk_inverse, walk_ws
  from pallas_kernels.mosaic_gpu.forward import BLOCK_V

  if name in OPERATOR:
    return _operator_case(name, r, shape)
  if name in ATTENTION:
    return _attention_case(name)
  if name not in KERNELS:
    raise ValueError(f"kernel case {name!r}: expected one of {KERNELS + OPERATOR + ATTENTION}")
  ops = jax.eval_shape(_prepared, *_inputs(r, shape))
  q, k, v, gamma, gamma_rows, beta_rows, mask_rows, scale = ops
  gates = (gamma, gamma_rows, beta_rows, mask_rows, scale)
  inverse = chunk_inverse.chunk_inverse
  if name == "chunk_inverse":
    return inverse, (k, beta_rows, mask_rows)
  t0 = jax.eval_shape(inverse, k, beta_rows, mask_rows)
  # the walk as a differentiated call runs it: final state, per-chunk states and new values
  walk = functools.partial(
    walk_ws.state_walk_ws, block_v=BLOCK_V, output_final_state=True, store_states=True
  )
  if name == "state_walk_ws":
    return (lambda q, k, v, t0, *gates: walk(q, k, v, t0, *gates)), (q, k, v, t0, *gates)
  _, final_t, states_t, vnew_t = jax.eval_shape(walk, q, k, v, t0, *gates)
  do = v  # the output's cotangent, shaped as v
  grad_walk = functools.partial(backward_walk.state_grad_walk, block_v=BLOCK_V)
  if name == "state_grad_walk":
    return grad_walk, (q, k, do, t0, *gates, final_t)
  dh_t, dvnew_t, _ = jax.eval_shape(grad_walk, q, k, do, t0, *gates, final_t)
  return chunk_grads.chunk_grads, (q, k, v, do, t0, states_t, vnew_t, dh_t, dvnew_t, *gates)


def profile(fn, specs, lower_only):
  """Trace, lower (for cuda with `lower_only`), compile, and two calls on zeros of jax.jit(fn)
  at `specs`; each kernel call's target and size in the lowered text."""
  from benchmarks.compile_profile import _count_pallas_calls

  events: list[tuple[str, float]] = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **_: events.append((name, secs))
  )
  t0 = time.perf_counter()
  traced = jax.jit(fn).trace(*specs)
  t1 = time.perf_counter()
  lowered = traced.lower(lowering_platforms=("cuda",)) if lower_only else traced.lower()
  t2 = time.perf_counter()
  text = lowered.as_text()
  calls = [line for line in text.splitlines() if "custom_call @" in line]
  record = dict(
    trace_s=round(t1 - t0, 3),
    lower_s=round(t2 - t1, 3),
    pallas_kernels=_count_pallas_calls(traced.jaxpr.jaxpr),
    lowered_chars=len(text),
    kernel_calls=[
      dict(target=line.split("custom_call @")[1].split("(")[0], chars=len(line)) for line in calls
    ],
  )
  if lower_only:
    return record
  compiled = lowered.compile()
  t3 = time.perf_counter()
  totals: dict[str, float] = {}
  for name, secs in events:
    totals[name] = totals.get(name, 0.0) + secs
  args = jax.block_until_ready([jnp.zeros(s.shape, s.dtype) for s in specs])
  t4 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t5 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t6 = time.perf_counter()
  return dict(
    record,
    compile_s=round(t3 - t2, 3),
    first_call_s=round(t5 - t4, 3),  # (a kernel compiled at its first run would show here)
    second_call_s=round(t6 - t5, 4),
    events={name: round(secs, 4) for name, secs in sorted(totals.items())},
  )


def kernel_cases(names, rs):
  """The `kernels` entry's cases, "name:r" (the attention's without r)."""
  known = KERNELS + OPERATOR + ATTENTION
  names = known if names is None else names
  unknown = [n for n in names if n not in known]
  if unknown:
    raise SystemExit(f"--kernels: unknown {unknown}; expected names from {', '.join(known)}")
  per_r = [f"{n}:{r}" for r in rs for n in names if n not in ATTENTION]
  return per_r + [n for n in names if n in ATTENTION]
