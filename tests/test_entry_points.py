"""`python -m gdp_jax demo | bench | train-lm`: thin entry points into examples/ and benchmarks/
(outside the package). They load their module from the checkout, and without the extra it needs,
or outside a checkout, say what to install instead of a traceback."""

from __future__ import annotations

import sys

import pytest

from gdp_jax import __main__ as cli

LAB = {"demo": "examples", "train-lm": "examples", "bench": "bench"}


@pytest.mark.parametrize("command", sorted(LAB))
def test_help_comes_from_the_lab_module(command, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main([command, "--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert f"python -m gdp_jax {command}" in out and "--out" in out or "--steps" in out, out


@pytest.mark.parametrize("command", sorted(LAB))
def test_a_missing_extra_is_named(command, monkeypatch, capsys):
  module_name = cli.LAB_COMMANDS[command][0]
  monkeypatch.delitem(sys.modules, module_name, raising=False)
  monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now fails as if not installed
  monkeypatch.setitem(sys.modules, "optax", None)
  assert cli.main([command, "--anything"]) == 2
  err = capsys.readouterr().err
  extra = LAB[command]
  assert f'pip install -e ".[{extra}]"' in err, err
  assert "tqdm" in err or "optax" in err, err


def test_outside_a_checkout_the_command_says_so(monkeypatch, capsys):
  monkeypatch.setattr(cli, "_checkout_root", lambda: None)
  assert cli.main(["bench", "--tiny"]) == 2
  err = capsys.readouterr().err
  assert "benchmarks/bench.py" in err and "repository" in err, err


def test_the_package_does_not_import_the_lab():
  """`import gdp_jax` and its submodules never load examples/ or benchmarks/."""
  import gdp_jax

  assert "bench" not in dir(gdp_jax) and "demo" not in dir(gdp_jax)
  with pytest.raises(AttributeError):
    _ = gdp_jax.train_lm
