"""`python -m benchmarks.bench` on CPU at a tiny shape: it runs, and its JSON has what it
promises."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

from benchmarks import bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TOP_FIELDS = (
  "schema",
  "tool",
  "command",
  "date",
  "device",
  "device_kind",
  "backend",
  "jax_version",
  "gdp_jax_version",
  "interpret_mode",
  "reps",
  "inner",
  "shapes",
  "rs",
  "dtypes",
  "modes",
  "impls",
  "timing",
  "flops_counted",
  "bytes_counted",
  "shape",
  "dtype",
  "cases",
)
CASE_FIELDS = ("impl", "mode", "B", "T", "H", "K", "V", "r", "dtype", "status")
OK_FIELDS = ("ms", "all_ms", "flops", "bytes", "tflops", "gbps")


def test_bench_command_tiny(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = bench.main(["--tiny", "--impls", "xla,reference,fla,jla", "--rs", "1,2", "--out", str(out)])
  assert rc == 0
  printed = capsys.readouterr().out
  assert "TFLOP/s" in printed and "GB/s" in printed and "ms" in printed
  res = json.loads(out.read_text())
  for field in TOP_FIELDS:
    assert field in res, field
  assert res["schema"] == bench.SCHEMA
  assert res["backend"] == "cpu"
  assert res["shapes"] == [dict(B=1, T=64, H=2, K=32, V=32)]
  assert res["rs"] == [1, 2] and res["modes"] == ["fwd", "fwdbwd"]
  cases = res["cases"]
  assert len(cases) == 2 * 2 * 4  # modes x rs x impls
  for c in cases:
    for field in CASE_FIELDS:
      assert field in c, (field, c)
    assert c["status"] in ("ok", "skipped", "error")
  by = {(c["impl"], c["mode"], c["r"]): c for c in cases}
  # Ours must run everywhere; a missing peer or an r it does not cover is skipped, not an error.
  for impl in ("xla", "reference"):
    for mode in ("fwd", "fwdbwd"):
      for r in (1, 2):
        c = by[(impl, mode, r)]
        assert c["status"] == "ok", c
        for field in OK_FIELDS:
          assert field in c, (field, c)
        assert c["ms"] > 0 and len(c["all_ms"]) == res["reps"]
        assert c["flops"] == bench.flops(mode, 1, 64, 2, 32, 32, r)
        assert c["bytes"] == bench.traffic_bytes(mode, 1, 64, 2, 32, 32, r, "bfloat16")
        assert c["tflops"] == pytest.approx(c["flops"] / c["ms"] / 1e9)
        assert c["gbps"] == pytest.approx(c["bytes"] / c["ms"] / 1e6)
  assert abs(by[("reference", "fwd", 1)]["max_abs_diff_vs_xla"]) < 2e-2  # bf16 outputs
  for impl in ("fla", "jla"):
    assert by[(impl, "fwd", 2)]["status"] == "skipped"
    assert "r = 1" in by[(impl, "fwd", 2)]["reason"]
  assert by[("fla", "fwd", 1)]["status"] in ("skipped", "ok")  # no CUDA here: skipped
  if importlib.util.find_spec("matplotlib") is not None:
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_operator_script_is_a_thin_caller(tmp_path):
  """benchmarks/bench_operator.py keeps its flags and runs the Pallas kernels (interpreted)."""
  spec = importlib.util.spec_from_file_location(
    "bench_operator", ROOT / "benchmarks" / "bench_operator.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = tmp_path / "op.json"
  rc = mod.main(
    [
      "--out",
      str(out),
      "--tiny",
      "--shape",
      "1,32,1,32,32",
      "--rs",
      "1",
      "--dtype",
      "f32",
      "--modes",
      "fwd",
      "--impls",
      "pallas,xla",
      "--reps",
      "2",
      "--inner",
      "1",
      "--no-plot",
    ]
  )
  assert rc == 0
  res = json.loads(out.read_text())
  assert [c["status"] for c in res["cases"]] == ["ok", "ok"], res["cases"]
  assert res["cases"][0]["max_abs_diff_vs_xla"] < 1e-4
  assert not out.with_suffix(".png").exists()
  with pytest.raises(SystemExit):
    mod.main(["--tiny"])  # --out stays required there


def test_counts():
  # r = 1, one chunk of 64 tokens, K = V = 64, B = H = 1: the formula term by term.
  n = c = 64
  k = v = 64
  expect = (
    2 * n * n * k
    + n**3 / 3
    + 2 * n * n * (k + v)
    + 2 * n * k * v
    + 2 * n * k * v
    + 2 * c * k * v
    + 2 * c * c * k
    + 2 * c * n * v
  )
  assert bench.forward_flops(1, 64, 1, 64, 64, 1) == pytest.approx(expect)
  assert bench.flops("fwdbwd", 1, 64, 1, 64, 64, 1) == pytest.approx(3 * expect)
  assert bench.forward_flops(1, 65, 1, 64, 64, 1) == pytest.approx(2 * expect)  # ceil(T / C)
  assert bench.flop_chunk(1) == 64 and bench.flop_chunk(2) == 32 and bench.flop_chunk(8) == 16
  # bf16 q, k, v [1, 10, 1, 8]; f32 g, beta; f32 [2, 2] mask; bf16 o.
  inputs = 3 * 80 * 2 + 2 * 10 * 4 + 4 * 4
  assert bench.traffic_bytes("fwd", 1, 10, 1, 8, 8, 2, "bfloat16") == inputs + 160
  assert bench.traffic_bytes("fwdbwd", 1, 10, 1, 8, 8, 2, "bfloat16") == 2 * inputs + 160


def test_kept_h200_results_load():
  """The H200 JSON files the project keeps load, and the older format gets its figures."""
  files = sorted(RESULTS.glob("*.json"))
  assert files, "benchmarks/results/ has no JSON"
  for path in files:
    res = json.loads(path.read_text())  # every kept file is valid JSON
    if "cases" in res:  # operator benchmark files
      assert "command" in res and "date" in res, path
      cases = bench.normalize_cases(res)
      ok = [c for c in cases if c["status"] == "ok"]
      assert ok, path
      for c in ok:
        assert c["tflops"] > 0 and c["gbps"] > 0
        assert c["B"] and c["T"] and c["dtype"] in ("bfloat16", "float16", "float32")
      assert "TFLOP/s" in bench.format_table(cases)


def test_bad_arguments_are_refused():
  for argv in (
    ["--shape", "1,2,3"],
    ["--impls", "nope"],
    ["--dtype", "f8"],
    ["--modes", "bwd"],
    ["--shape", "1,16,1,30,30", "--rs", "4"],
  ):
    with pytest.raises(SystemExit):
      bench.main(argv + ["--out", os.devnull, "--no-plot"])


def test_bench_varlen_smoke(tmp_path):
  """benchmarks/bench_varlen.py --smoke (the chunked jnp form standing in for the kernels, a few
  cases: interpret mode is too slow here) writes the JSON the GPU run records."""
  spec = importlib.util.spec_from_file_location(
    "bench_varlen", ROOT / "benchmarks" / "bench_varlen.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = tmp_path / "varlen.json"
  only = "packed f32 r=1,unpacked fwd ours,packed8 fwd ours,fwd fla"
  argv = ["--smoke", "--impl", "xla", "--reps", "2", "--inner", "1", "--only", only]
  assert mod.main(argv + ["--out", str(out)]) == 0
  res = json.loads(out.read_text())
  for field in ("schema", "date", "jax_version", "device_kind", "command", "goals", "ratios"):
    assert field in res, field
  assert "cases" not in res  # that key marks `python -m benchmarks.bench` files
  assert res["command"].startswith("python benchmarks/bench_varlen.py --smoke")
  assert str(tmp_path) not in res["command"] and "--out varlen.json" in res["command"]
  [case] = res["correctness"]
  assert case["status"] == "pass" and case["lengths"] == list(mod.SMOKE_LENGTHS)
  names = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
  names |= {"o (plain forward)", "final_state (plain forward)"}  # the jit without jax.grad
  assert set(case["arrays"]) == names  # r = 1: no mask
  for err in case["arrays"].values():
    assert err["ok"] and err["rel_rms"] == 0.0 and err["tolerance"] in (2e-5, 1e-4)
  speed = {(c["layout"], c["mode"], c["impl"]): c for c in res["speed"]}
  for layout in ("unpacked", "packed8"):
    assert speed[(layout, "fwd", "ours")]["ms"] > 0, speed[(layout, "fwd", "ours")]
  assert speed[("packed8", "fwd", "ours")]["sequences"] == 2
  assert speed[("packed64", "fwd", "fla")]["status"] == "skipped"  # no CUDA here
  ratio = res["ratios"]["ours packed8/unpacked fwd"]
  assert ratio["goal"] == 1.10 and ratio["ratio"] > 0
  with pytest.raises(SystemExit):
    mod.main(["--smoke", "--sections", "nope", "--out", str(out)])
