"""The operator, the step and GQA decode under plain `jax.jit` with sharded inputs
(docs/sharding.md#under-plain-jaxjit): their Pallas kernels run per device on their block of
batch rows and heads, with no gather, and the operator runs context parallel on a split sequence.

jax fixes its device count when it starts, so the cases of `tests/partitioning_checks.py` run in
a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8: inputs sharded over
batch x grouped value heads, the sequence, batch x grouped heads x sequence and, with T not a
multiple of the chunk, batch x heads and (the Householder form) batch x heads x sequence (and
"xla", the jnp chunked form, on batch x sequence, with a jvp); forward,
final state and every gradient against one device, the outputs' and gradients' shardings,
and the compiled program's collectives (none that move data; with the sequence split only the
all-gathers of the small per-piece states); the one-token step, GQA decode and paged GQA
decode likewise (forward only). `tests/model_partitioning_checks.py` the same way: a `HybridLM`
training step with its parameters sharded by their annotations
(docs/sharding.md#annotated-parameters), and its decode (`step_tokens`, `step`) against one
device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from gdp_jax.ops.partitioning_vjp import _fold, _folded, _unfolded, vjp_specs

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "partitioning_checks.py")
MODEL_SCRIPT = os.path.join(HERE, "model_partitioning_checks.py")


def test_sharded_inputs_run_the_kernels_per_device():
  run_checks(SCRIPT)


def test_annotated_model_trains_data_x_tensor_parallel():
  """`tests/model_partitioning_checks.py`: a `HybridLM` training step on a 2 x 4 (data x model)
  mesh, parameters sharded by their annotations, equals one device and moves no activation."""
  run_checks(MODEL_SCRIPT)


def _sine(x):
  return (jnp.sin(x),)


def test_unsplit_backward_after_split_forward_is_nan():
  """A per-shard function that may run with its sequence split saves a last residual, 1 from
  the unsplit forward, 0 (a placeholder) from the split one: the unsplit backward after a split
  forward returns NaN gradients, never wrong ones (gdp_jax/ops/partitioning.py)."""
  x = jnp.linspace(-1.0, 1.0, 2 * 8 * 2 * 4).reshape(2, 8, 2, 4)
  specs = vjp_specs(_sine, ("bth-",), ("bth-",), 2, 1, x)
  assert specs.forward.results == ("bth-", "bth-", "")  # sin x; the residual cos x; the flag
  out, cos, flag = specs.forward.fn(x)
  assert float(flag) == 1.0
  ct = jnp.full_like(x, 0.5)
  (dx,) = specs.backward.fn(x, cos, flag, ct)
  np.testing.assert_allclose(dx, 0.5 * jnp.cos(x), rtol=1e-6)
  (dx,) = specs.backward.fn(x, jnp.zeros_like(cos), jnp.zeros_like(flag), ct)
  assert bool(jnp.all(jnp.isnan(dx)))


def test_chunk_count_folds_into_the_sequence():
  """A residual laid out by chunk ([B, H, T/C, K, V], a state per chunk) is passed between the
  per-shard calls folded into [B, H, T, K V / C], so that a device's piece of whole chunks holds
  exactly its own chunks (gdp_jax/ops/partitioning.py, `_fold`)."""
  labels, fold = _fold("bhc--", (2, 4, 2, 16, 8), 32)
  assert labels == "bht-" and fold == ("chunks", 2, 16, (16, 8))
  x = jnp.arange(2 * 4 * 2 * 16 * 8, dtype=jnp.float32).reshape(2, 4, 2, 16, 8)
  folded = _folded(x, fold)
  assert folded.shape == (2, 4, 32, 8)
  np.testing.assert_array_equal(_unfolded(folded, fold), x)
  for piece in range(2):  # the sequence in two pieces of one chunk each
    block = folded[:, :, 16 * piece : 16 * (piece + 1)]
    np.testing.assert_array_equal(_unfolded(block, fold), x[:, :, piece : piece + 1])
  quarter = folded[:, :, :8]  # half a chunk: no residual has this block's shape
  assert _unfolded(quarter, fold).shape == quarter.shape


def run_checks(script):
  env = dict(os.environ)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, script], capture_output=True, text=True, env=env, timeout=1800
  )
  results, expected = [], None
  for line in proc.stdout.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if "name" in row:
      results.append(row)
    expected = row.get("cases", expected)
  report = "\n".join(f"[{r['ok']}] {r['name']} ({r['seconds']} s): {r['detail']}" for r in results)
  failed = [r for r in results if not r["ok"]]
  assert not failed, f"{len(failed)} case(s) failed:\n{report}"
  assert proc.returncode == 0, f"exit status {proc.returncode}\n{report}\n{proc.stderr[-4000:]}"
  assert expected and len(results) == expected, (
    f"{len(results)} of {expected} cases reported:\n{report}\n{proc.stderr[-4000:]}"
  )
