"""Several devices (gdp_jax.sharding): the sharded operator, step, layer and a hybrid model
training step against one device, on 8 simulated CPU devices.

jax fixes its device count when it starts, so the test runs the groups of
`tests/sharding_checks.py` in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, paying jax's start once. What each group
checks is in that file; in short: forward, final state and every gradient equal one device for
r = 1, 2, 4, masks [r, r], [H, r, r], [B, T, H, r, r], with and without an initial state,
batch / head parallel and the sequence split into 2, 4 and 8 pieces; the compiled programs move
no q, k or v between devices; one case on the Pallas kernels (interpreted); the one-token step;
the Flax layer with the sequence split; a training step of the hybrid model on a 2 x 4 (data x
model) mesh; `python -m benchmarks.bench --devices 4` (forward).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "sharding_checks.py")


def run_groups(groups):
  env = dict(os.environ)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, SCRIPT, *groups], capture_output=True, text=True, env=env, timeout=1200
  )
  results = []
  for line in proc.stdout.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if "group" in row:
      results.append(row)
  return proc, results


# Every group of sharding_checks.GROUPS, in one process (about a minute on two cores: a second
# process would pay jax's start and the groups' shared compiles again).
PROCESSES = [("operator_a", "operator_b", "step", "api", "pallas", "model", "bench")]


def test_every_group_runs():
  """PROCESSES lists every group of sharding_checks.py once (read without importing it: the
  import would start jax with 8 devices here)."""
  with open(SCRIPT) as f:
    tree = ast.parse(f.read())
  groups = next(
    ast.literal_eval(n.value)
    for n in tree.body
    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "GROUPS"
  )
  assert sorted(sum(PROCESSES, ())) == sorted(groups)


@pytest.mark.parametrize("groups", PROCESSES, ids=["_".join(p) for p in PROCESSES])
def test_sharding_group(groups):
  proc, results = run_groups(groups)
  failed = [r for r in results if r["ok"] is False]
  report = "\n".join(f"[{r['ok']}] {r['name']} ({r['seconds']} s): {r['detail']}" for r in results)
  assert not failed, f"{len(failed)} check(s) failed:\n{report}"
  assert proc.returncode == 0, (
    f"exit status {proc.returncode}\n{report}\nstderr:\n{proc.stderr[-4000:]}"
  )
  ran = {r["group"] for r in results}
  assert ran == set(groups), (
    f"groups with no results: {set(groups) - ran}\nstderr:\n{proc.stderr[-4000:]}"
  )
  skipped = [r for r in results if r["ok"] is None]
  assert not skipped, f"skipped on 8 simulated devices:\n{report}"
