"""Checks of the operator under plain `jax.jit` with sharded inputs
(docs/sharding.md#under-plain-jaxjit): the Pallas kernels (interpreted on CPU) run per device,
with no gather of q, k, v or o.

jax fixes its device count when it starts, so `tests/test_partitioning.py` runs this file in a
subprocess with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/partitioning_checks.py

Each case places the inputs with `NamedSharding`s (batch x heads with a per-head mask split
over the heads and T = 40, not a multiple of the chunk, which each device pads on its own
block, so nothing is resharded; batch x grouped value heads, the sequence, batch x grouped value
heads x sequence) and runs
`gated_delta_product(..., implementation="triton")` and its gradients under one `jax.jit`:
outputs, final state and every gradient equal one device (the "reference" implementation); o,
the final state and the gradients keep the inputs' sharding; and the compiled program has no
all-gather, all-to-all or collective-permute (the only collective allowed is the all-reduce
that sums a broadcast mask's gradient over the devices sharing it).
A sequence-sharded input runs context parallel: the same checks, and the only data-moving
collectives are the all-gathers of the small float32 per-piece [.., K, K + V] states (in the
forward, and again in the backward, which runs the transition call again): "sequence" has
pieces of half a chunk (the backward differentiates the whole piece again), "batch x grouped
heads x sequence" whole chunks (the first call's residuals saved), the Householder case pieces
of 20 sub-steps that each device pads to whole chunks (no residuals saved: the backward runs the
forward again on each piece). "xla batch x sequence"
runs the jnp chunked form ("xla") the same way (whole chunks: its saved chunk inverses and
states split by chunk), and its jvp under `jax.jit` too; the Pallas cases' jvp under `jax.jit` is
the operator's NotImplementedError while tracing (reverse mode only).
The Householder form (the operator over the T * n_h sub-steps, 40 of them) is checked likewise,
on a batch x heads x sequence mesh.
The one-token step and dense and paged GQA decode are checked the same way (forward only).
Each case prints one JSON line {"name", "ok", "detail", "seconds"}; the exit status is 0 when
every case passed. On a machine with several GPUs, `--real` uses the devices as they are
(compiled kernels; a case that needs more devices than there are is skipped, "ok": null).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

REAL = "--real" in sys.argv
if not REAL:
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gdp_jax import (  # noqa: E402
  gated_delta_product,
  gated_delta_product_step,
  gqa_decode,
  householder_delta_product,
  paged_gqa_decode,
)
from tests.cases import loss_and_grads, make_inputs, rel_err  # noqa: E402
from tests.sharding_checks import collectives  # noqa: E402

TOL = 2e-5
GRAD_TOL = 1e-4
B, T, H, K, V = 2, 32, 4, 16, 8

# (name, mesh axes {name: size}, r, mask kind, initial state, grouped value heads[, T[,
# implementation]]): the axes "data" split the batch, "model" the heads, "seq" the sequence.
# T = 40 is not a multiple of the chunk (16): each device pads its own block. The paths of the
# operator's partitioning, one case each: T not a multiple of the chunk without a sequence split
# (each device pads its block; the backward recomputes the forward) and with one (the
# Householder case below: each piece padded), whole chunks without a sequence split (residuals
# saved), a split into pieces of half a chunk ("sequence": the backward differentiates the whole
# piece again) and into whole chunks (the first call's residuals saved); "xla", the jnp chunked
# form, on its own path.
CASES = [
  ("batch x heads, T = 40", {"data": 2, "model": 4}, 2, "head", True, False, 40),
  ("batch x grouped heads", {"data": 2, "model": 2}, 2, "token", True, True),
  ("sequence", {"seq": 4}, 2, "token", False, False),
  ("batch x grouped heads x sequence", {"data": 2, "model": 2, "seq": 2}, 2, "shared", True, True),
  ("xla batch x sequence", {"data": 2, "seq": 2}, 2, "token", True, False, 64, "xla"),
]


class _Skip(Exception):
  pass


def make_mesh(axes):
  """A mesh with Auto axes of exactly the devices `axes` ({name: size}) needs."""
  need = math.prod(axes.values())
  if need > jax.device_count():
    raise _Skip(f"needs {need} devices, {jax.device_count()} here")
  types = (AxisType.Auto,) * len(axes)
  return jax.make_mesh(
    tuple(axes.values()), tuple(axes), axis_types=types, devices=jax.devices()[:need]
  )


def specs(axes, mask_kind):
  """The inputs' PartitionSpecs: q, k, v, g, beta [B, T, H, ...] as ("data", "seq", "model");
  a per-head mask over "model", a per-token one like g; the state as ("data", "model")."""
  b, t, h = (a if a in axes else None for a in ("data", "seq", "model"))
  mask = {None: None, "shared": P(), "head": P(h), "token": P(b, t, h)}[mask_kind]
  tokens = P(b, t, h)
  return dict(q=tokens, k=tokens, v=tokens, g=tokens, beta=tokens, mask=mask, initial_state=P(b, h))


def same_spec(a, b, ndim):
  pad = lambda s: tuple(s) + (None,) * (ndim - len(tuple(s)))
  return pad(a) == pad(b)


def run_case(case, seed):
  name, axes, r, mask_kind, with_state, grouped, *rest = case
  mesh = make_mesh(axes)
  t_len = rest[0] if rest else T
  implementation = rest[1] if len(rest) > 1 else "triton"
  inp = make_inputs(
    seed, B=B, T=t_len, H=H, K=K, V=V, r=r, mask_kind=mask_kind, with_state=with_state
  )
  if grouped:  # two value heads per key head: q, k [B, T, H/2, K]
    inp["q"], inp["k"] = inp["q"][:, :, ::2], inp["k"][:, :, ::2]
  inp = {n: x for n, x in inp.items() if x is not None}
  layout = specs(axes, mask_kind)
  placed = {n: jax.device_put(x, NamedSharding(mesh, layout[n])) for n, x in inp.items()}

  def operator(implementation, **kw):
    return gated_delta_product(
      **kw, output_final_state=True, implementation=implementation, chunk_size=16
    )

  precision = {"precision": "ieee"} if implementation == "triton" else {}
  partitioned = lambda **kw: operator(implementation, **precision, **kw)
  reference = lambda **kw: operator("reference", **kw)
  both = lambda fn: jax.jit(lambda a: (fn(**a), loss_and_grads(fn, a, seed)))
  compiled = both(partitioned).lower(placed).compile()
  (o, final), grads = compiled(placed)
  (o1, final1), grads1 = both(reference)(inp)
  errs = dict(o=rel_err(o, o1), final=rel_err(final, final1))
  errs.update({f"d{n}": rel_err(grads[n], grads1[n]) for n in grads1})
  worst = {n: e for n, e in errs.items() if e > (TOL if n in ("o", "final") else GRAD_TOL)}
  assert not worst, f"relative errors above tolerance: {worst} (all: {errs})"
  note = f"max rel err {max(errs.values()):.2e}"
  if implementation == "xla":  # forward mode too: its wrapper is a custom_jvp
    tangent = lambda fn, a: jax.jvp(lambda q: fn(**{**a, "q": q})[0], (a["q"],), (a["k"],))[1]
    err = rel_err(jax.jit(tangent, static_argnums=0)(partitioned, placed), tangent(reference, inp))
    assert err <= TOL, f"jvp: relative error {err}"
    note += f"; jvp under jit rel err {err:.2e}"
  else:  # forward mode of a custom_vjp of kernels: the operator's clear error while tracing
    tangent = lambda a: jax.jvp(lambda q: partitioned(**{**a, "q": q})[0], (a["q"],), (a["k"],))
    try:
      jax.jit(tangent).trace(placed)
    except NotImplementedError as error:
      assert "reverse-mode first derivatives only" in str(error), error
    else:
      raise AssertionError("jax.jvp under jax.jit traced without the operator's error")
  moved = collectives(compiled.as_text())
  if "seq" in axes:
    note += "; " + check_piece_gathers(moved)
  else:
    assert not moved, f"the compiled program moves data between devices: {moved}"
  assert same_spec(o.sharding.spec, layout["q"], 4), f"o: {o.sharding.spec}"
  state_spec = layout["initial_state"]
  assert same_spec(final.sharding.spec, state_spec, 4), f"final: {final.sharding.spec}"
  for n, grad in grads.items():
    assert same_spec(grad.sharding.spec, layout[n], grad.ndim), f"d{n}: {grad.sharding.spec}"
  gathers = "" if "seq" in axes else "; no all-gather"
  return note + "; outputs and gradients keep the inputs' sharding" + gathers


def check_piece_gathers(moved):
  """Context parallel moves only the float32 per-piece [.., K, K + V] (transition | state)
  pairs, by all-gather; never q, k, v, o or their gradients."""
  piece = lambda c: c[0].startswith("all-gather") and c[1] == "f32" and c[2][-2:] == (K, K + V)
  bad = [c for c in moved if not piece(c)]
  assert not bad, f"collectives other than the piece states' all-gathers: {bad}"
  assert moved, "no all-gather of the piece states: the sequence was not split"
  return f"only all-gathers of the piece states {sorted(set(c[2] for c in moved))}"


# The Householder form (the r = 1 operator over the T * n_h sub-steps): (name, mesh axes, T).
# T * n_h = 40 sub-steps, not a multiple of the chunk: the sequence in pieces of 10 tokens (20
# sub-steps) that each device pads to whole chunks (no residuals saved: the backward runs the
# forward again on each piece), next to a batch and a head split.
HOUSEHOLDER_CASES = [
  ("householder batch x heads x sequence, T = 20", {"data": 2, "model": 2, "seq": 2}, 20),
]


def run_householder_case(case, seed):
  name, axes, t_len = case
  mesh = make_mesh(axes)
  n_h = 2
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  k = normal(B, t_len * n_h, H, K)
  inp = dict(
    q=normal(B, t_len, H, K),
    k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
    v=normal(B, t_len * n_h, H, V),
    g=-jnp.abs(normal(B, t_len, H)) * 0.2,
    beta=jax.nn.sigmoid(normal(B, t_len * n_h, H)),
    initial_state=normal(B, H, K, V),
  )
  layout = specs(axes, None)
  placed = {n: jax.device_put(x, NamedSharding(mesh, layout[n])) for n, x in inp.items()}

  def householder(implementation, **kw):
    return householder_delta_product(
      **kw,
      num_householder=n_h,
      output_final_state=True,
      implementation=implementation,
      chunk_size=16,
      **({"precision": "ieee"} if implementation == "triton" else {}),
    )

  both = lambda fn: jax.jit(lambda a: (fn(**a), loss_and_grads(fn, a, seed)))
  compiled = both(lambda **kw: householder("triton", **kw)).lower(placed).compile()
  (o, final), grads = compiled(placed)
  (o1, final1), grads1 = both(lambda **kw: householder("reference", **kw))(inp)
  errs = dict(o=rel_err(o, o1), final=rel_err(final, final1))
  errs.update({f"d{n}": rel_err(grads[n], grads1[n]) for n in grads1})
  worst = {n: e for n, e in errs.items() if e > (TOL if n in ("o", "final") else GRAD_TOL)}
  assert not worst, f"relative errors above tolerance: {worst} (all: {errs})"
  gathers = check_piece_gathers(collectives(compiled.as_text()))
  assert same_spec(o.sharding.spec, layout["q"], 4), f"o: {o.sharding.spec}"
  for n, grad in grads.items():
    assert same_spec(grad.sharding.spec, layout[n], grad.ndim), f"d{n}: {grad.sharding.spec}"
  return f"max rel err {max(errs.values()):.2e}; {gathers}; o and gradients keep the sharding"


# The one-token step (inference: no gradients): (name, mesh axes, mask kind, array scale).
STEP_CASES = [
  ("step batch x heads", {"data": 2, "model": 4}, "head", False),
  ("step batch x grouped heads, array scale", {"data": 2, "model": 2}, "token", True),
]


def run_step_case(case, seed):
  name, axes, mask_kind, array_scale = case
  mesh = make_mesh(axes)
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  heads_k = H // 2 if "grouped" in name else H
  r = 2
  k = normal(B, heads_k, K)
  inp = dict(
    q=normal(B, heads_k, K),
    k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
    v=normal(B, H, V),
    g=-jnp.abs(normal(B, H)) * 0.2,
    beta=jax.nn.sigmoid(normal(B, H)),
    mask={"head": normal(H, r, r), "token": normal(B, H, r, r)}[mask_kind],
    state=normal(B, H, K, V),
  )
  b, h = (a if a in axes else None for a in ("data", "model"))
  layout = dict(q=P(b, h), k=P(b, h), v=P(b, h), g=P(b, h), beta=P(b, h), state=P(b, h))
  layout["mask"] = P(h) if mask_kind == "head" else P(b, h)
  placed = {n: jax.device_put(x, NamedSharding(mesh, layout[n])) for n, x in inp.items()}
  scale = jnp.float32(0.3) if array_scale else 0.3

  def step(implementation):
    return jax.jit(
      lambda a, s: gated_delta_product_step(**a, scale=s, implementation=implementation)
    )

  compiled = step("triton").lower(placed, scale).compile()
  o, new = compiled(placed, scale)
  o1, new1 = step("xla")(inp, scale)
  errs = (rel_err(o, o1), rel_err(new, new1))
  assert max(errs) <= TOL, f"relative errors (o, state): {errs}"
  moved = collectives(compiled.as_text())
  assert not moved, f"the compiled program moves data between devices: {moved}"
  assert same_spec(o.sharding.spec, layout["v"], 3), f"o: {o.sharding.spec}"
  assert same_spec(new.sharding.spec, layout["state"], 4), f"state: {new.sharding.spec}"
  return f"max rel err {max(errs):.2e}; outputs keep the inputs' sharding; no all-gather"


# GQA decode, dense and paged (inference): (name, mesh axes, paged). Four query heads read two
# cache heads; the page pools are split over the heads only (every sequence may use any page).
DECODE_CASES = [
  ("gqa_decode batch x heads", {"data": 2, "model": 2}, False),
  ("paged_gqa_decode batch x heads", {"data": 2, "model": 2}, True),
]


def run_decode_case(case, seed):
  name, axes, paged = case
  mesh = make_mesh(axes)
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  hq, hkv, d, s, page = 4, 2, 16, 64, 16
  b, h = (a if a in axes else None for a in ("data", "model"))
  inp = dict(query=normal(B, hq, d), lengths=jnp.asarray([37, 64], jnp.int32))
  layout = dict(query=P(b, h), lengths=P(b))
  if paged:
    pages = B * s // page
    inp.update(
      key_pages=normal(pages, page, hkv, d),
      value_pages=normal(pages, page, hkv, d),
      block_tables=jnp.asarray(rng.permutation(pages).reshape(B, -1), jnp.int32),
    )
    layout.update(key_pages=P(None, None, h), value_pages=P(None, None, h), block_tables=P(b))
    function = paged_gqa_decode
  else:
    inp.update(key_cache=normal(B, s, hkv, d), value_cache=normal(B, s, hkv, d))
    layout.update(key_cache=P(b, None, h), value_cache=P(b, None, h))
    function = gqa_decode
  placed = {n: jax.device_put(x, NamedSharding(mesh, layout[n])) for n, x in inp.items()}
  decode = lambda implementation: jax.jit(lambda a: function(**a, implementation=implementation))
  compiled = decode("triton").lower(placed).compile()
  o = compiled(placed)
  err = rel_err(o, decode("xla")(inp))
  assert err <= TOL, f"relative error {err}"
  moved = collectives(compiled.as_text())
  assert not moved, f"the compiled program moves data between devices: {moved}"
  assert same_spec(o.sharding.spec, layout["query"], 3), f"o: {o.sharding.spec}"
  return f"rel err {err:.2e}; the output keeps the query's sharding; no all-gather"


def main(argv):
  """Runs the cases named in argv (all when none)."""
  argv = [a for a in argv if a != "--real"]
  cases = [(run_case, c) for c in CASES] + [(run_householder_case, c) for c in HOUSEHOLDER_CASES]
  cases += [(run_step_case, c) for c in STEP_CASES]
  cases += [(run_decode_case, c) for c in DECODE_CASES]
  cases = [(run, c) for run, c in cases if not argv or c[0] in argv]
  print(json.dumps(dict(devices=jax.device_count(), cases=len(cases))), flush=True)
  failed = 0
  for seed, (run, case) in enumerate(cases):
    t0 = time.perf_counter()
    try:
      detail, ok = run(case, seed), True
    except _Skip as e:
      detail, ok = f"skipped: {e}", None
    except Exception as e:  # report and go on
      detail, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", False
    failed += ok is False
    line = dict(name=case[0], ok=ok, detail=detail, seconds=round(time.perf_counter() - t0, 2))
    print(json.dumps(line), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
