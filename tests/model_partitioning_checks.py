"""A data x tensor parallel training step of `HybridLM` under plain `jax.jit`, its parameters
sharded by their annotations (docs/sharding.md#annotated-parameters), against one device.

jax fixes its device count when it starts, so `tests/test_partitioning.py` runs this file in a
subprocess with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/model_partitioning_checks.py

On a 2 x 4 ("data", "model") mesh: the parameters of a `HybridLM` with every kind of layer are
placed by `nnx.get_partition_spec` under `nnx.logical_axis_rules(LOGICAL_AXIS_RULES)` and the
tokens over "data"; one jitted step (loss, gradients, an SGD update) on the Pallas kernels gives
the loss and the updated parameters of the same step on one device (the recurrence there); the
parameters keep their sharding; the compiled step gathers no sequence activation (no
all-gather, all-to-all or collective-permute of an array with the batch x sequence tokens); and
a model created under the mesh and the rules has its parameters sharded as they are annotated
(flax's eager sharding); and decoding (`step_tokens`, then `step`) with the sharded parameters
gives the logits and caches of one device (values only: the decode path still moves
activations, docs/sharding.md). Each case
prints one JSON line {"name", "ok", "detail", "seconds"}; the exit status is 0 when every case
passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gdp_jax.layers import LOGICAL_AXIS_RULES, HouseholderDeltaProduct  # noqa: E402
from gdp_jax.models import HybridConfig, HybridLM  # noqa: E402
from tests.cases import rel_err  # noqa: E402
from tests.sharding_checks import collectives  # noqa: E402

LOSS_TOL = 1e-5  # float32, relative
PARAM_TOL = 1e-5  # float32 parameters after one SGD step, relative
B, T = 6, 24  # apart from every parameter's dimensions: activations are [B or B/2, T, ...]
CONFIG = HybridConfig(
  vocab_size=16,
  hidden_size=32,
  layer_pattern="DHA",  # block mask, DeltaProduct, attention
  num_heads=4,
  head_dim=8,
  num_blocks=2,
  mask_mode="token",
  attn_num_heads=4,
  attn_num_kv_heads=4,
  mlp_ratio=2,
  chunk_size=16,
  implementation="xla",
)


def mesh_2x4():
  return jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8]
  )


def train_step_for(graphdef, rest, specs=None):
  """(params, tokens) -> (loss, new params): cross-entropy of the next token, one SGD step; the
  new parameters constrained to `specs` (their annotated sharding, as a training loop keeps
  them), if given."""
  tx = optax.sgd(0.1)

  def train_step(params, tokens):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    params = optax.apply_updates(params, updates)
    if specs is not None:
      params = jax.lax.with_sharding_constraint(params, specs)
    return loss, params

  return jax.jit(train_step)


def same_spec(a, b, ndim):
  pad = lambda s: tuple(s) + (None,) * (ndim - len(tuple(s)))
  return pad(a) == pad(b)


def split_model(implementation):
  """(graphdef, parameters, the rest) of the `HybridLM` of CONFIG on `implementation`."""
  config = dataclasses.replace(CONFIG, implementation=implementation)
  return nnx.split(HybridLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)


# One device runs the operator's recurrence ("reference"; the layers' steps the jnp step): the
# sharded kernels are held to it directly (the cheapest program to compile on one device; the
# kernels equal the reference on one device in the operator's tests).
ONE_DEVICE = "reference"


def training_step(implementation):
  mesh = mesh_2x4()
  graphdef, params, rest = split_model(implementation)
  tokens = jax.random.randint(jax.random.key(2), (B, T + 1), 0, CONFIG.vocab_size, jnp.int32)
  graphdef1, _, rest1 = split_model(ONE_DEVICE)
  loss1, new1 = train_step_for(graphdef1, rest1)(params, tokens)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = nnx.get_partition_spec(params)
    placed = jax.jit(lambda p: jax.lax.with_sharding_constraint(p, specs))(params)
    tokens8 = jax.device_put(tokens, P("data", None))
    step = train_step_for(graphdef, rest, specs)
    compiled = step.lower(placed, tokens8).compile()
    loss8, new8 = compiled(placed, tokens8)

  split = [path for path, spec in nnx.to_flat_state(specs) if "model" in spec.get_value()]
  for i in range(len(CONFIG.layer_pattern)):
    for proj in ("q_proj", "o_proj"):
      path = ("blocks", i, "mixer", proj, "kernel")
      assert path in split, f"{path} is not split over 'model' ({split})"
  loss_err = abs(float(loss8) - float(loss1)) / abs(float(loss1))
  flat1, flat8 = dict(nnx.to_flat_state(new1)), dict(nnx.to_flat_state(new8))
  errs = {path: rel_err(flat8[path].get_value(), v.get_value()) for path, v in flat1.items()}
  worst = max(errs, key=errs.get)
  assert loss_err <= LOSS_TOL, f"loss {float(loss8)} vs {float(loss1)} on one device"
  assert errs[worst] <= PARAM_TOL, f"parameter {worst}: rel err {errs[worst]:.2e}"

  for path, spec in nnx.to_flat_state(specs):
    value = flat8[path].get_value()
    got = value.sharding
    want = NamedSharding(mesh, spec.get_value())
    assert got.is_equivalent_to(want, value.ndim), f"{path}: {got.spec} after the step, not {want}"

  # No sequence activation moves between devices: nothing gathered or permuted is [B or B / 2,
  # T or T * n_h, ...] (the operator's q, k, v, o, the projections' inputs and outputs).
  moved = collectives(compiled.as_text())
  tokens = [c for c in moved if c[2][:1] in ((B,), (B // 2,)) and c[2][1:2] in ((T,), (2 * T,))]
  assert not tokens, f"the compiled step moves activations between devices: {sorted(set(tokens))}"
  return (
    f"loss {float(loss8):.6f} vs {float(loss1):.6f} (rel {loss_err:.1e}); parameters after SGD "
    f"max rel err {errs[worst]:.1e}; {len(split)} parameters split over 'model' keep their "
    f"sharding; no activation moved (parameters' collectives: {sorted(set(moved))})"
  )


def eager_sharding():
  """Created under the mesh and the rules, each parameter is sharded as annotated."""
  mesh = mesh_2x4()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    params = nnx.state(HybridLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    specs = nnx.get_partition_spec(params)
  checked = 0
  for (path, spec), (_, value) in zip(nnx.to_flat_state(specs), nnx.to_flat_state(params)):
    value = value.get_value()
    want = NamedSharding(mesh, spec.get_value())
    assert value.sharding.is_equivalent_to(want, value.ndim), f"{path}: {value.sharding}"
    checked += 1
  one = nnx.state(HybridLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
  for (path, a), (_, b) in zip(nnx.to_flat_state(params), nnx.to_flat_state(one)):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(path))
  return f"{checked} parameters sharded at creation as annotated, values as on one device"


def layer_prefill_cache():
  """A DeltaProduct layer's whole sequence and its cache under the mesh (columns taken head by
  head, `DeltaMixer._convolved_qkv`) equal one device, ragged lengths included."""
  mesh = mesh_2x4()
  layer = HouseholderDeltaProduct(
    32, 4, 8, num_householder=2, implementation="xla", rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(1), (B, T, 32), jnp.float32)
  lengths = jnp.array([T, 5, 17, 1, T, 9], jnp.int32)
  run = nnx.jit(lambda m, x, n: m(x, n, return_cache=True))
  y1, cache1 = run(layer, x, lengths)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = nnx.get_partition_spec(nnx.state(layer))
    nnx.update(layer, jax.device_put(nnx.state(layer), specs))
    y8, cache8 = run(layer, jax.device_put(x, P("data")), jax.device_put(lengths, P("data")))
  errs = dict(y=rel_err(y8, y1), conv=rel_err(cache8.conv, cache1.conv))
  errs["state"] = rel_err(cache8.state, cache1.state)
  assert max(errs.values()) <= 1e-5, errs
  return f"outputs and cache against one device: {errs}"


def decode_steps(implementation):
  """`HybridLM.step_tokens` (three tokens from an empty cache) then `step` (one token) with the
  parameters sharded by their annotations, under one `jax.jit`: the logits and the caches equal
  one device. Reports the collectives of batch-sized arrays the compiled decode holds."""
  mesh = mesh_2x4()
  tokens = jax.random.randint(jax.random.key(3), (B, 4), 0, CONFIG.vocab_size, jnp.int32)

  def decode_for(graphdef, rest):
    @jax.jit
    def decode(params, tokens):
      model = nnx.merge(graphdef, params, rest)
      cache = model.init_cache(B, 8)
      logits3, cache = model.step_tokens(tokens[:, :3], cache)
      logits1, cache = model.step(tokens[:, 3], cache)
      return logits3, logits1, cache

    return decode

  graphdef, params, rest = split_model(implementation)
  decode = decode_for(graphdef, rest)
  graphdef1, _, rest1 = split_model(ONE_DEVICE)
  one = decode_for(graphdef1, rest1)(params, tokens)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = nnx.get_partition_spec(params)
    placed = jax.jit(lambda p: jax.lax.with_sharding_constraint(p, specs))(params)
    tokens8 = jax.device_put(tokens, P("data", None))
    compiled = decode.lower(placed, tokens8).compile()
    eight = compiled(placed, tokens8)
  errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(eight), jax.tree.leaves(one))]
  assert max(errs) <= 1e-5, f"logits and caches against one device: rel errs {errs}"
  moved = collectives(compiled.as_text())
  rows = sorted({c for c in moved if c[2][:1] in ((B,), (B // 2,))})
  return f"logits and caches max rel err {max(errs):.1e}; batch-sized arrays moved: {rows}"


# The training step runs the Pallas kernels (interpreted on a CPU): the same checks hold for the
# jnp form, whose annotated layers are checked under the mesh by the prefill case below (and
# whose training step over a ShardingConfig by tests/sharding_checks.py's model group).
CASES = [
  (
    "HybridLM training step, data 2 x model 4, Pallas kernels (interpreted)",
    lambda: training_step("triton"),
  ),
  ("HybridLM created under the mesh: eager sharding", eager_sharding),
  ("HouseholderDeltaProduct prefill cache under the mesh", layer_prefill_cache),
  (
    "HybridLM decode (step_tokens, step), Pallas kernels (interpreted)",
    lambda: decode_steps("triton"),
  ),
]


def main(argv):
  cases = [(name, fn) for name, fn in CASES if not argv or name in argv]
  print(json.dumps(dict(devices=jax.device_count(), cases=len(cases))), flush=True)
  failed = 0
  for name, fn in cases:
    t0 = time.perf_counter()
    try:
      detail, ok = fn(), True
    except Exception as e:  # report and go on
      detail, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", False
    failed += not ok
    line = dict(name=name, ok=ok, detail=detail, seconds=round(time.perf_counter() - t0, 2))
    print(json.dumps(line), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
