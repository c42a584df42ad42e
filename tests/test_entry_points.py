"""The command lines: the package's (`python -m gdp_jax check | info`) runs only what the package
holds; the lab runs from a checkout by its own entry points (`python -m examples.s3_demo`,
`python -m examples.byte_lm`, `python -m benchmarks.bench`), which name a missing extra in one
line instead of a traceback."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

from gdp_jax import __main__ as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _lab_mains():
  from benchmarks import bench
  from examples.byte_lm.__main__ import main as byte_lm
  from examples.s3_demo.__main__ import main as s3_demo

  return {
    "python -m examples.s3_demo": (s3_demo, "examples"),
    "python -m examples.byte_lm": (byte_lm, "examples"),
    "python -m benchmarks.bench": (bench.main, "bench"),
  }


@pytest.mark.parametrize("prog", sorted(_lab_mains()))
def test_help_of_each_lab_entry_point(prog, capsys):
  main, _ = _lab_mains()[prog]
  with pytest.raises(SystemExit) as info:
    main(["--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: {prog}") and ("--out" in out or "--steps" in out), out


@pytest.mark.parametrize("prog", sorted(_lab_mains()))
def test_a_missing_extra_is_named(prog, monkeypatch, capsys):
  from benchmarks import bench

  main, extra = _lab_mains()[prog]
  monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now fails as if not installed
  monkeypatch.setattr(bench, "tqdm", None)  # as bench.py's import found it
  assert main(["--anything"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"{prog} needs 'tqdm', from the `{extra}` extra: pip install -e \".[{extra}]\"", err


def test_the_package_command_line_holds_check_and_info(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert "{check,info}" in out and "python -m examples.s3_demo" in out, out
  for lab in ("demo", "train-lm", "bench"):
    with pytest.raises(SystemExit) as info:
      cli.main([lab])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_info_names_versions_and_implementations(capsys):
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("gdp-jax ") and "gated_delta_product: implementation=None runs" in out


def test_the_package_does_not_import_the_lab():
  """No module of gdp_jax/ or pallas_kernels/ imports examples/ or benchmarks/, or loads a file
  by its path (importlib.util)."""
  for path in sorted([*ROOT.glob("gdp_jax/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]):
    text = path.read_text()
    assert "spec_from_file_location" not in text, path
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        where = path.relative_to(ROOT)
        assert top not in ("examples", "benchmarks", "tests"), f"{where} imports {name}"
        assert name != "importlib.util", f"{where} imports {name}"
