"""scripts/set_repo_url.py points the notebooks' badges and install cells at a repository."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_script():
  spec = importlib.util.spec_from_file_location("set_repo_url", ROOT / "scripts/set_repo_url.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_rewrites_badges_and_install_cells(tmp_path, monkeypatch):
  script = _load_script()
  notebook = tmp_path / "01_quickstart.ipynb"
  shutil.copy(ROOT / "notebooks/01_quickstart.ipynb", notebook)
  readme = tmp_path / "README.md"
  shutil.copy(ROOT / "README.md", readme)
  bench_notebook = tmp_path / "04_benchmarks.ipynb"  # also clones the repository
  shutil.copy(ROOT / "notebooks/04_benchmarks.ipynb", bench_notebook)
  monkeypatch.setattr(script, "FILES", [notebook, readme, bench_notebook])
  assert script.current() == {"gdp-jax/gdp-jax"}
  assert script.main(["someone/a-fork"]) == 0
  assert script.current() == {"someone/a-fork"}
  cells = json.loads(notebook.read_text())["cells"]
  assert "github/someone/a-fork/blob/main/notebooks/01_quickstart.ipynb" in "".join(
    cells[0]["source"]
  )
  assert "git+https://github.com/someone/a-fork.git" in "".join(cells[1]["source"])
  assert "github/someone/a-fork/blob/main/notebooks/" in readme.read_text()
  for path in (notebook, bench_notebook):  # links, install cells, clone
    assert "gdp-jax/gdp-jax" not in path.read_text(), path.name
  assert "github.com/gdp-jax/gdp-jax" not in readme.read_text()


def test_refuses_a_bad_name(tmp_path, monkeypatch):
  script = _load_script()
  monkeypatch.setattr(script, "FILES", [])
  try:
    script.main(["not a repo"])
  except SystemExit as e:
    assert "OWNER/NAME" in str(e)
  else:
    raise AssertionError("a bad repository name was accepted")
