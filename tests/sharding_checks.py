"""Checks of `gdp_jax.sharding` on several devices: sharded results against one device.

jax fixes its device count when it starts, so `tests/test_sharding.py` runs this file in a
subprocess with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_checks.py GROUP ...

On a machine with several GPUs, `--real` uses the devices as they are (meshes that need more
devices than there are are skipped) and `--impl pallas` runs the operator cases on the compiled
kernels (scripts/multi_gpu_check.sh).

Groups: operator_a, operator_b (the sharded operator, forward, final state and every
gradient, plus the compiled program's collectives), pallas (one case on the Pallas kernels),
step (the one-token step), model (the Flax layer with the sequence split, and a training step of
the hybrid model on a 2 x 4 data x model mesh), api (ShardingConfig, placement, Explicit meshes,
errors), bench (`python -m benchmarks.bench --devices 4`; the forward on simulated devices,
forward and backward with --real). Each check prints one JSON line
{"group", "name", "ok", "detail", "seconds"}; the exit status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback

if "--real" not in sys.argv:
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P

from gdp_jax import gated_delta_product, gated_delta_product_step  # noqa: E402
from gdp_jax.sharding import (
  ShardingConfig,
  sharded_gated_delta_product,  # noqa: E402
  sharded_gated_delta_product_step,
)
from tests.cases import loss_and_grads, make_inputs, rel_err  # noqa: E402

TOL = 2e-5  # float32 forward and final state against one device
GRAD_TOL = 1e-4  # float32 gradients
B, T, H, K, V = 2, 32, 4, 16, 8
ROLE_AXES = {"batch": "data", "heads": "model", "sequence": "seq"}

# (r, mask kind, with initial state, layout): every r; each mask shape, with a sequence split (a
# token mask is cut along the sequence, a head mask along the heads); with and without an initial
# state under a sequence split; the sequence split into 2, 4 and 8 pieces, alone (8) and next to
# batch and heads, and batch x heads without it. (One case per layout or mask feature: the
# operator's math at every r and mask shape is checked on one device in test_implementations.py.)
LAYOUT_BH = {"batch": 2, "heads": 4}
CASES = {
  "operator_a": [
    (1, None, True, LAYOUT_BH),
    (1, "token", False, {"sequence": 2, "batch": 2, "heads": 2}),
    (2, "shared", False, {"sequence": 8}),
  ],
  "operator_b": [
    (4, "head", True, {"sequence": 4, "heads": 2}),
    (4, "token", False, {"sequence": 4, "batch": 2}),
  ],
}

RESULTS = []
REAL = "--real" in sys.argv
# Float32 matmuls of the kernels in full float32 (the GPU default is TF32), so float32 results
# compare with the float32 reference at the tolerances above.
FULL = "ieee"


def record(group, name, fn):
  t0 = time.perf_counter()
  try:
    detail = fn()
    ok = True
  except _Skip as e:
    ok, detail = None, f"skipped: {e}"
  except Exception as e:  # report and go on
    ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
  line = dict(
    group=group, name=name, ok=ok, detail=detail, seconds=round(time.perf_counter() - t0, 2)
  )
  RESULTS.append(line)
  print(json.dumps(line), flush=True)


class _Skip(Exception):
  pass


def fit(layout, n):
  """With fewer than the layout's devices (--real): halve its largest split until it fits."""
  layout = dict(layout)
  while int(np.prod(list(layout.values()) or [1])) > n:
    role = max(layout, key=layout.get)
    layout[role] //= 2
  return {r: s for r, s in layout.items() if s > 1}


def make_config(layout, explicit=False):
  """A mesh of exactly the devices the layout needs, its axes named by role."""
  if REAL:
    layout = fit(layout, jax.device_count())
  roles = [r for r in ("batch", "sequence", "heads") if layout.get(r, 1) > 1]
  sizes = [layout[r] for r in roles] or [1]
  names = [ROLE_AXES[r] for r in roles] or ["data"]
  need = int(np.prod(sizes))
  if need > jax.device_count():
    raise _Skip(f"needs {need} devices, {jax.device_count()} here")
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
  mesh = jax.make_mesh(tuple(sizes), tuple(names), axis_types=types, devices=jax.devices()[:need])
  return ShardingConfig(mesh, **{r: ROLE_AXES[r] for r in roles})


def same_spec(a, b, ndim):
  """PartitionSpecs equal up to trailing Nones."""
  pad = lambda s: tuple(s) + (None,) * (ndim - len(tuple(s)))
  return pad(a) == pad(b)


def layout_name(layout):
  return "x".join(f"{k}{v}" for k, v in layout.items())


def collectives(hlo):
  """[(op, dtype, dims)] of the data-moving collectives in compiled HLO text."""
  found = []
  for line in hlo.splitlines():
    m = re.search(
      r"=\s*(.*?)\s(all-gather|all-gather-start|all-to-all|collective-permute|"
      r"collective-permute-start)\(",
      line,
    )
    if m:
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
        found.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
  return found


def check_collectives(hlo, sequence_split):
  """Batch and head parallel moves no data; context parallel gathers only the small float32
  per-piece [.., K, K + V] transition and state pairs. Never q, k or v."""
  moved = collectives(hlo)
  if not sequence_split:
    assert not moved, f"batch/head parallel program moves data: {moved}"
    return "no all-gather / all-to-all / collective-permute"
  bad = [
    c
    for c in moved
    if not (c[0].startswith("all-gather") and c[1] == "f32" and c[2][-2:] == (K, K + V))
  ]
  assert not bad, f"unexpected collectives (only the [.., {K}, {K + V}] states may move): {bad}"
  assert moved, "context parallel program has no all-gather of the piece states"
  return f"only all-gathers of the piece states: {sorted(set(c[2] for c in moved))}"


# ----------------------------------------------------------------------------------------------
# Groups
# ----------------------------------------------------------------------------------------------


def run_case(group, case, impl, seed):
  r, mask_kind, with_state, layout = case
  if REAL:
    layout = fit(layout, jax.device_count())
  name = (
    f"{impl} r={r} mask={mask_kind or 'none'} state={'yes' if with_state else 'no'} "
    f"{layout_name(layout)}"
  )

  def check():
    cfg = make_config(layout)
    inp = make_inputs(
      seed, B=B, T=T, H=H, K=K, V=V, r=r, mask_kind=mask_kind, with_state=with_state
    )
    sharded = lambda **kw: sharded_gated_delta_product(
      **kw,
      sharding=cfg,
      output_final_state=True,
      implementation=impl,
      chunk_size=16,
      precision=FULL,
    )
    single = lambda **kw: gated_delta_product(
      **kw, output_final_state=True, implementation="reference"
    )
    both = lambda fn: jax.jit(lambda a: (fn(**a), loss_and_grads(fn, a, seed)))
    placed = dict(cfg.put(**{n: x for n, x in inp.items() if x is not None}))
    compiled = both(sharded).lower(placed).compile()
    (o, final), grads = compiled(placed)
    (o1, final1), grads1 = both(single)(inp)
    errs = dict(o=rel_err(o, o1), final=rel_err(final, final1))
    errs.update({f"d{n}": rel_err(grads[n], grads1[n]) for n in grads1})
    worst = {n: e for n, e in errs.items() if e > (TOL if n in ("o", "final") else GRAD_TOL)}
    assert not worst, f"relative errors above tolerance: {worst} (all: {errs})"
    assert same_spec(o.sharding.spec, cfg.spec_for("o", 4), 4), o.sharding.spec
    note = check_collectives(compiled.as_text(), layout.get("sequence", 1) > 1)
    return f"max rel err {max(errs.values()):.2e}; {note}"

  record(group, name, check)


def group_operator(group, impl):
  for i, case in enumerate(CASES[group]):
    run_case(group, case, impl, seed=i)


def group_pallas(impl):
  # The Pallas kernels (interpreted on CPU) under shard_map: sequence, batch and heads split.
  run_case("pallas", (2, "head", True, {"sequence": 2, "batch": 2, "heads": 2}), "pallas", 7)


def group_step(impl):
  cfg = make_config(LAYOUT_BH)
  r = 2
  rng = np.random.default_rng(3)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = n(B, H, K), n(B, H, K), n(B, H, V)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g, beta = -jnp.abs(n(B, H)) * 0.2, jax.nn.sigmoid(n(B, H))
  masks = {"[r,r]": n(r, r), "[H,r,r]": n(H, r, r), "[B,H,r,r]": n(B, H, r, r)}
  for (mname, mask), state in zip(list(masks.items()) * 2, [n(B, H, K, V)] * 3 + [None] * 3):

    def check(mask=mask, state=state):
      f = jax.jit(
        lambda *a: sharded_gated_delta_product_step(
          *a, sharding=cfg, implementation=impl, precision=FULL
        )
      )
      o, new = f(q, k, v, g, beta, mask, state)
      o1, new1 = gated_delta_product_step(q, k, v, g, beta, mask, state, implementation="xla")
      errs = (rel_err(o, o1), rel_err(new, new1))
      assert max(errs) <= TOL, errs
      assert same_spec(new.sharding.spec, cfg.spec_for("state", 4), 4), new.sharding.spec
      hlo = f.lower(q, k, v, g, beta, mask, state).compile().as_text()
      assert not collectives(hlo), collectives(hlo)
      return f"rel err {max(errs):.2e}, no collectives"

    record("step", f"{impl} mask {mname} state={'yes' if state is not None else 'no'}", check)

  def grads_and_scale():
    # The Pallas step is an inference kernel (it writes the state in place: no autodiff), so
    # the gradients of the sharded step are checked on the jnp step.
    impl_g = "xla" if impl == "pallas" else impl
    mask, state = masks["[B,H,r,r]"], n(B, H, K, V)
    scale = jnp.float32(0.3)

    def loss(fn):
      def f(*a):
        o, new = fn(*a[:6], a[6], scale=scale)
        return jnp.sum(o * o) + jnp.sum(new * jnp.cos(new))

      return jax.jit(jax.grad(f, argnums=tuple(range(7))))

    gs = loss(
      lambda *a, **kw: sharded_gated_delta_product_step(
        *a, **kw, sharding=cfg, implementation=impl_g
      )
    )(q, k, v, g, beta, mask, state)
    g1 = loss(lambda *a, **kw: gated_delta_product_step(*a, **kw, implementation="xla"))(
      q, k, v, g, beta, mask, state
    )
    errs = [rel_err(a, b) for a, b in zip(gs, g1)]
    assert max(errs) <= GRAD_TOL, errs
    return f"gradients of all 7 inputs (array scale), max rel err {max(errs):.2e}"

  record("step", f"{'xla' if impl == 'pallas' else impl} gradients, traced scale", grads_and_scale)


def group_model(impl):
  import optax
  from flax import nnx

  from gdp_jax.layers import GatedDeltaProduct
  from gdp_jax.models import HybridConfig, HybridLM

  # One device runs the operator's recurrence ("reference"; the layers' steps the jnp step): the
  # cheapest program to compile, which the sharded layers and model are held to.
  def layer_sequence_split():
    cfg = make_config({"sequence": 2, "batch": 2, "heads": 2})
    make = lambda sharding, implementation: GatedDeltaProduct(
      32,
      4,
      8,
      num_blocks=2,
      mask_mode="token",
      chunk_size=16,
      implementation=implementation,
      sharding=sharding,
      rngs=nnx.Rngs(0),
    )
    one, split = make(None, "reference"), make(cfg, impl)
    x = jax.random.normal(jax.random.key(1), (2, 32, 32), jnp.float32)
    xs = cfg.put(x=x)["x"]
    run = nnx.jit(lambda m, x: m(x, return_cache=True))
    (y, cache), (y1, cache1) = run(split, xs), run(one, x)
    step = nnx.jit(lambda m, x, c: m.step(x, c))
    (ys, _), (ys1, _) = step(split, x[:, -1], cache), step(one, x[:, -1], cache1)
    errs = dict(
      y=rel_err(y, y1),
      state=rel_err(cache.state, cache1.state),
      conv=rel_err(cache.conv, cache1.conv),
      step=rel_err(ys, ys1),
    )
    assert max(errs.values()) <= 1e-4, errs
    return f"layer over batch 2 x seq 2 x heads 2 and its step: {errs}"

  record("model", f"{impl} GatedDeltaProduct layer, sequence split", layer_sequence_split)

  def training_step():
    cfg = make_config({"batch": 2, "heads": 4})
    config = HybridConfig(
      vocab_size=16,
      hidden_size=32,
      layer_pattern="DA",
      num_heads=4,
      head_dim=8,
      num_blocks=2,
      attn_num_heads=4,
      attn_num_kv_heads=2,
      mlp_ratio=2,
      chunk_size=16,
      implementation=impl,
    )
    tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, 16, jnp.int32)
    tx = optax.sgd(0.1)  # linear in the gradients: the new parameters compare as they do

    def train_step_for(model):
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)

      @jax.jit
      def train_step(params, opt_state, tokens):
        def loss_fn(params):
          m = nnx.merge(graphdef, params, rest)
          logits = m(tokens[:, :-1])
          return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates)

      return train_step, params

    one_device = dataclasses.replace(config, implementation="reference")
    step1, params1 = train_step_for(HybridLM(one_device, rngs=nnx.Rngs(0)))
    step8, params8 = train_step_for(HybridLM(config, rngs=nnx.Rngs(0), sharding=cfg))
    loss1, grads1, new1 = step1(params1, tx.init(params1), tokens)
    loss8, grads8, new8 = step8(params8, tx.init(params8), cfg.put(tokens=tokens)["tokens"])
    assert abs(float(loss8) - float(loss1)) <= 1e-5 * abs(float(loss1)), (loss8, loss1)
    g_err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads1)))
    p_err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(new8), jax.tree.leaves(new1)))
    assert g_err <= GRAD_TOL and p_err <= 1e-5, (g_err, p_err)
    return (
      f"loss {float(loss8):.6f} vs {float(loss1):.6f}; gradients max rel err {g_err:.2e}; "
      f"parameters after one SGD step {p_err:.2e}"
    )

  record("model", f"{impl} HybridLM training step, data 2 x model 4", training_step)


def group_api(impl):
  def placement_and_specs():
    cfg = make_config({"batch": 2, "sequence": 2, "heads": 2})
    assert cfg.spec_for("q", 4) == P("data", "seq", "model", None)
    assert cfg.spec_for("mask", 2) == P(None, None)
    assert cfg.spec_for("mask", 3) == P("model", None, None)
    assert cfg.spec_for("mask", 5) == P("data", "seq", "model", None, None)
    assert cfg.spec_for("initial_state", 4) == P("data", "model", None, None)
    assert cfg.size("sequence") == 2 and cfg.axes("batch") == ("data",)
    inp = make_inputs(0, B=B, T=T, H=H, K=K, V=V, r=2, mask_kind="head")
    placed = cfg.put(**inp)
    for n, x in placed.items():
      assert same_spec(x.sharding.spec, cfg.spec_for(n, x.ndim), x.ndim), (n, x.sharding.spec)
      shard = x.addressable_shards[0].data.shape
      expect = tuple(
        d // (cfg.mesh.shape[a] if isinstance(a, str) else 1)
        for d, a in zip(x.shape, tuple(x.sharding.spec) + (None,) * x.ndim)
      )
      assert shard == expect, (n, shard, expect)
    return "specs and put() placement"

  record("api", "ShardingConfig specs and placement", placement_and_specs)

  def tuple_axes_and_explicit():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)
    cfg = ShardingConfig(mesh, batch=None, heads=("a", "b"), sequence="c")
    assert cfg.size("heads") == 4 and cfg.spec_for("q", 4) == P(None, "c", ("a", "b"), None)
    inp = make_inputs(1, B=B, T=T, H=H, K=K, V=V, r=2, mask_kind="token")
    with jax.set_mesh(mesh):
      o, final = jax.jit(
        lambda a: sharded_gated_delta_product(
          **a, sharding=cfg, output_final_state=True, implementation=impl, chunk_size=16
        )
      )(inp)
    o1, final1 = gated_delta_product(**inp, output_final_state=True, implementation="reference")
    errs = (rel_err(o, o1), rel_err(final, final1))
    assert max(errs) <= TOL, errs
    return f"heads over two axes, Explicit mesh axes: rel err {max(errs):.2e}"

  record("api", "tuple of axes, Explicit mesh", tuple_axes_and_explicit)

  def errors():
    cfg = make_config({"batch": 2, "sequence": 4})
    mesh = cfg.mesh
    inp = make_inputs(0, B=B, T=T, H=H, K=K, V=V, r=2, mask_kind="head")
    expect = [
      (TypeError, "mesh must be", lambda: ShardingConfig("mesh", batch="data")),
      (ValueError, "has axes", lambda: ShardingConfig(mesh, batch="nope")),
      (ValueError, "both", lambda: ShardingConfig(mesh, batch="data", heads="data")),
      (TypeError, "axis name", lambda: ShardingConfig(mesh, batch=3)),
      (TypeError, "ShardingConfig", lambda: sharded_gated_delta_product(**inp, sharding="data")),
      (
        ValueError,
        "B = 3",
        lambda: sharded_gated_delta_product(
          **make_inputs(0, B=3, T=T, H=H, K=K, V=V, r=2), sharding=cfg
        ),
      ),
      (
        ValueError,
        "T = 30",
        lambda: sharded_gated_delta_product(
          **make_inputs(0, B=B, T=30, H=H, K=K, V=V, r=2), sharding=cfg
        ),
      ),
      (
        ValueError,
        "mask has shape",
        lambda: sharded_gated_delta_product(**dict(inp, mask=jnp.ones((3, 2, 2))), sharding=cfg),
      ),
      (
        TypeError,
        "scale",
        lambda: sharded_gated_delta_product(**inp, sharding=cfg, scale=jnp.float32(0.5)),
      ),
      (
        ValueError,
        "B = 3",
        lambda: sharded_gated_delta_product_step(
          *[jnp.ones((3, H, K))] * 2,
          jnp.ones((3, H, V)),
          None,
          jnp.ones((3, H)),
          None,
          None,
          sharding=cfg,
        ),
      ),
      (ValueError, "no layout", lambda: cfg.spec_for("w", 2)),
    ]
    for exc, text, fn in expect:
      try:
        fn()
      except exc as e:
        assert text in str(e), (text, str(e))
      else:
        raise AssertionError(f"no {exc.__name__} containing {text!r}")
    from flax import nnx

    from gdp_jax.layers import GatedDeltaProduct

    try:
      GatedDeltaProduct(32, 3, 8, sharding=make_config({"heads": 2}), rngs=nnx.Rngs(0))
    except ValueError as e:
      assert "num_heads = 3" in str(e), str(e)
    else:
      raise AssertionError("no ValueError for num_heads = 3 over 2 head pieces")
    return f"{len(expect) + 1} bad inputs raise clear errors"

  record("api", "errors", errors)


def group_bench(impl):
  n = min(4, jax.device_count())
  impls = ["xla"] if impl == "xla" else ["xla", impl]  # xla on one device: the yardstick
  bh = {4: "bh2x2", 2: "bh2x1", 1: "bh1x1"}[n]
  # simulated devices: the forward only (the sharded gradients are the operator groups' checks)
  modes = "fwd,fwdbwd" if REAL else "fwd"

  def bench_devices():
    import tempfile

    from benchmarks import bench

    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "bench.json")
      rc = bench.main(
        [
          "--devices",
          str(n),
          "--shape",
          "2,64,2,32,32",
          "--rs",
          "2",
          "--modes",
          modes,
          "--impls",
          ",".join(impls),
          "--reps",
          "1",
          "--no-plot",
          "--no-progress",
          "--out",
          out,
        ]
      )
      assert rc == 0, rc
      with open(out) as f:
        res = json.load(f)
    assert res["devices"] == n
    by = {(c["impl"], c["mode"]): c for c in res["cases"]}
    assert set(by) == {
      (f"{i}{sfx}", m) for i in impls for sfx in ("", f" {bh}", f" cp{n}") for m in modes.split(",")
    }, sorted(by)
    for c in by.values():
      assert c["status"] == "ok" and c["ms"] > 0, c
    assert by[(f"{impl} cp{n}", "fwd")]["mesh"] == {"seq": n}
    assert by[(f"{impl} {bh}", "fwd")]["mesh"] == {
      "data": 2 if n > 1 else 1,
      "model": n // 2 if n > 1 else 1,
    }
    diffs = {
      name: by[(name, "fwd")]["max_abs_diff_vs_xla"] for name in (f"{impl} {bh}", f"{impl} cp{n}")
    }
    assert max(diffs.values()) < 2e-2, diffs  # bf16 outputs against one device
    return f"bench --devices {n}: one device, {bh}, cp{n} all timed; |o - xla| {diffs}"

  record("bench", f"{impl} python -m benchmarks.bench --devices {n}", bench_devices)


GROUPS = ("operator_a", "operator_b", "pallas", "step", "model", "api", "bench")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("groups", nargs="*", default=list(GROUPS), help=f"from {', '.join(GROUPS)}")
  p.add_argument(
    "--impl",
    default="xla",
    help="operator implementation for the cases (xla by default; pallas on GPUs)",
  )
  p.add_argument(
    "--real",
    action="store_true",
    help="use the machine's devices as they are (no simulated CPU devices)",
  )
  args = p.parse_args(argv)
  print(
    json.dumps(
      dict(devices=jax.device_count(), backend=jax.default_backend(), jax=jax.__version__)
    ),
    flush=True,
  )
  for group in args.groups:
    if group not in GROUPS:
      raise SystemExit(f"unknown group {group!r}; choose from {', '.join(GROUPS)}")
    # The layers pass no precision: near-float32 products (tf32x3) on a GPU for them.
    with jax.default_matmul_precision("highest"):
      if group.startswith("operator"):
        group_operator(group, args.impl)
      else:
        globals()[f"group_{group}"](args.impl)
  failed = [r for r in RESULTS if r["ok"] is False]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
