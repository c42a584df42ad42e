"""scripts/gpu_matrix.py: the plan (slices, shards), the queue its processes share, the summary,
and a `--tiny --self-check --jobs 2` run.

The tiny run is a subprocess with two worker processes (three configurations in interpret mode
on the CPU, about 40 s on two cores); its first configuration carries a planted mismatch that the
merged JSON and the exit code must report, while the other two must pass.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import gpu_matrix  # noqa: E402

TOP_FIELDS = (
  "schema",
  "date",
  "jax_version",
  "jaxlib_version",
  "gpu",
  "device",
  "platform",
  "interpret_mode",
  "default_precision",
  "shape",
  "chunk_size",
  "cache_dir",
  "jobs",
  "xla_flags",
  "against",
  "reference_compiler_options",
  "tolerances",
  "tf32_tolerance",
  "command",
  "wall_s",
  "configs",
  "summary",
)
RECORD_FIELDS = (
  "key",
  "dtype",
  "K",
  "V",
  "r",
  "mask",
  "precision",
  "mask_shape",
  "tolerance",
  "planted",
  "reference_s",
  "reference_compile_s",
  "reference_run_s",
  "fwd",
  "bwd",
  "reference_error",
  "errors",
  "status",
  "failures",
  "seconds",
)
STAGE_FIELDS = (
  "lower_s",
  "compile_s",
  "run_s",
  "cache_hit",
  "first_compile_s",
  "ok",
  "error",
  "phase",
)
SUMMARY_FIELDS = (
  "configs",
  "totals",
  "passed",
  "failed",
  "failures",
  "slowest_compiles",
  "over_60s",
  "compiles",
  "cache_hits",
  "worst_error_over_tolerance",
  "not_run",
  "lost",
)


def listed(capsys, *argv):
  assert gpu_matrix.main(["--list", *argv]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[-1] == f"{len(lines) - 1} configurations"
  return lines[:-1]


def test_plan_covers_the_matrix_and_slices_it(capsys):
  every = listed(capsys)
  # 10 (K, V) pairs x 4 r x 3 masks, for bf16, f16, and f32 at two precisions.
  assert len(every) == len(set(every)) == 10 * 4 * 3 * 4
  assert "f16 K=96 V=96 r=8 mask=token" in every
  assert "f32 ieee K=64 V=128 r=1 mask=none" in every
  assert "f32 tf32 K=256 V=64 r=4 mask=shared" in every
  assert listed(capsys, "--only", "r=8", "--dtype", "bf16") == [
    k for k in every if k.startswith("bf16 ") and " r=8 " in k
  ]
  assert listed(capsys, "--only", "mask=none", "--only", "K=16") == [
    k for k in every if k.endswith("mask=none") and " K=16 " in k
  ]
  assert len(listed(capsys, "--only", "precision=ieee")) == 120
  # Shards partition the plan, and the two float32 precisions of a shape stay together.
  shards = [listed(capsys, "--shard", f"{i}/3") for i in range(3)]
  assert sorted(sum(shards, [])) == sorted(every)
  for part in shards:
    ieee = {k.replace(" ieee ", " ") for k in part if " ieee " in k}
    tf32 = {k.replace(" tf32 ", " ") for k in part if " tf32 " in k}
    assert ieee == tf32


def test_queue_hands_each_group_to_one_process_slowest_first(tmp_path, capsys):
  """Two processes' `claimed` generators over one queue folder, taking turns: every
  configuration runs once, the float32 precisions of a shape in the same process, and the groups
  are claimed slowest first (largest r, then K + V)."""
  keys = listed(capsys, "--rs", "1,8", "--dims", "16,64", "--dtype", "f32,bf16")
  configs = [
    c for c in gpu_matrix.plan(_args("--rs", "1,8", "--dims", "16,64", "--dtype", "f32,bf16"))
  ]
  assert [c.key for c in configs] == keys
  workers = [gpu_matrix.claimed(configs, str(tmp_path)) for _ in range(2)]
  taken = [[], []]
  order = []
  active = [0, 1]
  while active:
    for w in list(active):
      config = next(workers[w], None)
      if config is None:
        active.remove(w)
        continue
      taken[w].append(config)
      if config.group not in order:
        order.append(config.group)
  assert sorted(c.key for c in taken[0] + taken[1]) == sorted(keys)
  assert taken[0] and taken[1]
  for w in (0, 1):
    assert not {c.group for c in taken[w]} & {c.group for c in taken[1 - w]}
  assert [g[3] for g in order] == sorted((g[3] for g in order), reverse=True)
  assert order[0][:4] == ("f32", 64, 64, 8)  # the slowest: r = 8, the largest K + V, float32
  assert len(list(tmp_path.iterdir())) == len(order)  # one claim file per group


def test_the_two_references_agree():
  """`--against reference` (the recurrence) gives what `--against xla` gives, outputs and
  gradients, on a tiny configuration (float32 at HIGHEST precision both)."""
  import numpy as np

  config = gpu_matrix.Config(*gpu_matrix.TINY_CONFIGS[2])  # r = 2, a per-token mask
  results = {}
  for against in ("xla", "reference"):
    (out, grads), error, (compile_s, run_s) = gpu_matrix.reference(
      config, _args("--tiny", "--against", against)
    )
    assert error is None and compile_s > 0 and run_s > 0
    results[against] = (out, grads)
  for x, y in zip(*(jax.tree.leaves(results[a]) for a in ("xla", "reference"))):
    assert gpu_matrix.host_rel_err(x, y) < 1e-5 and np.any(np.asarray(y) != 0)


def _args(*argv):
  """The namespace main() builds for argv (the plan's fields)."""
  captured = {}
  original = gpu_matrix.plan

  def spy(args, shard=None):
    captured.setdefault("args", args)
    return original(args, shard)

  gpu_matrix.plan = spy
  try:
    gpu_matrix.main(["--list", *argv])
  finally:
    gpu_matrix.plan = original
  return captured["args"]


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--only", "rank=2"], "KEY=VALUE"),
    (["--shard", "3/3"], "0 <= I < N"),
    (["--dims", "16,x"], "--dims"),
    (["--dtype", "f64"], "--dtype"),
  ],
)
def test_bad_arguments_are_clear(argv, message):
  with pytest.raises(SystemExit, match=message):
    gpu_matrix.main(["--list", *argv])


def test_summary_flags_slow_compiles_and_failures():
  def rec(key, fwd_s, bwd_s, status="pass", hit=False):
    stage = lambda s: dict(compile_s=s, first_compile_s=s if not hit else 70.0, cache_hit=hit)
    return dict(
      key=key,
      dtype="bf16",
      precision=None,
      fwd=stage(fwd_s),
      bwd=stage(bwd_s),
      errors={"o": 1e-3},
      tolerance=dict(forward=3e-2, gradient=5e-2),
      status=status,
      failures=[] if status == "pass" else ["dq: relative error 1 > 0.05"],
    )

  summary = gpu_matrix.summarize(
    [rec("a", 1.0, 61.0), rec("b", 2.0, 3.0, "fail"), rec("c", 0.1, 0.2, hit=True)]
  )
  assert summary["failed"] == 1 and summary["failures"][0]["key"] == "b"
  assert [(c["key"], c["stage"]) for c in summary["over_60s"]] == [
    ("c", "fwd"),
    ("c", "bwd"),
    ("a", "bwd"),
  ]  # a cached 70 s first compile counts
  assert summary["slowest_compiles"][3]["key"] == "b"
  assert summary["cache_hits"] == 2 and summary["compiles"] == 6
  assert summary["totals"]["bwd_compile_s"] == 64.2 and summary["totals"]["fwd_run_s"] == 0


def test_tiny_run_reports_a_planted_mismatch(tmp_path):
  out = tmp_path / "matrix.json"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [
      sys.executable,
      "scripts/gpu_matrix.py",
      "--tiny",
      "--self-check",
      "--out",
      str(out),
      "--cache-dir",
      str(tmp_path / "cache"),
      "--jobs",
      "2",
    ],
    check=False,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  for field in TOP_FIELDS:
    assert field in result, field
  assert result["command"].startswith("python scripts/gpu_matrix.py --tiny")
  assert result["platform"] == "cpu" and result["interpret_mode"] is True
  assert result["cache_dir"] == str(tmp_path / "cache")
  assert result["jobs"] == 2 and not (tmp_path / "matrix.json.parts").exists()
  configs = result["configs"]
  assert [c["key"] for c in configs] == [gpu_matrix.Config(*c).key for c in gpu_matrix.TINY_CONFIGS]
  for c in configs:
    for field in RECORD_FIELDS:
      assert field in c, (c["key"], field)
    for stage in ("fwd", "bwd"):
      for field in STAGE_FIELDS:
        assert field in c[stage], (c["key"], stage, field)
      assert c[stage]["ok"] and c[stage]["compile_s"] > 0 and c[stage]["lower_s"] > 0
      assert c[stage]["run_s"] > 0
    grads = {"d" + n for n in ("q", "k", "v", "g", "beta", "initial_state")}
    grads |= {"dmask"} if c["mask"] != "none" else set()
    assert set(c["errors"]) == {"o", "final_state"} | grads
  # each configuration computed its own reference (three shapes): its time is recorded
  assert all(c["reference_s"] > 0 for c in configs)
  assert all(c["reference_compile_s"] > 0 and c["reference_run_s"] > 0 for c in configs)
  assert result["reference_compiler_options"] == gpu_matrix.REFERENCE_COMPILER_OPTIONS
  planted, *others = configs
  assert planted["planted"] and planted["status"] == "fail"
  assert any(f.startswith("o: relative error") for f in planted["failures"])
  assert any(f.startswith("dq: relative error") for f in planted["failures"])
  for c in others:
    assert not c["planted"] and c["status"] == "pass", c["failures"]
    for name, err in c["errors"].items():
      bound = c["tolerance"]["forward" if name in ("o", "final_state") else "gradient"]
      assert 0 <= err <= bound, (c["key"], name, err)
  summary = result["summary"]
  for field in SUMMARY_FIELDS:
    assert field in summary, field
  assert summary["configs"] == 3 and summary["passed"] == 2 and summary["failed"] == 1
  assert [f["key"] for f in summary["failures"]] == [planted["key"]]
  assert summary["compiles"] == 6 and len(summary["slowest_compiles"]) == 6
  assert summary["not_run"] == [] and summary["lost"] == []
  assert "FAIL" in proc.stdout and "2/3 passed" in proc.stdout
