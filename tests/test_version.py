"""The package reports the version pyproject.toml declares, and CHANGELOG.md has an entry for it."""

from __future__ import annotations

import pathlib
import tomllib

import gdp_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_matches_pyproject():
  declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
  assert gdp_jax.__version__ == declared


def test_changelog_has_the_version():
  assert f"## {gdp_jax.__version__}" in (ROOT / "CHANGELOG.md").read_text()
