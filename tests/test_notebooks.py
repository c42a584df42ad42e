"""Execute every notebook in notebooks/ top to bottom (CPU, small sizes), as a user would.

Each runs in a fresh Jupyter kernel of this Python (ipykernel and nbclient come with the test
extras; the test writes its own kernel spec pointing at sys.executable), with notebooks/ as the
working directory. GDP_NOTEBOOK_SMOKE=1 tells a notebook it runs in CI: those that train cut
their step counts (the notebooks say where).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL = "gdp-jax-tests"


def test_there_are_notebooks():
  names = [p.stem for p in PATHS]
  assert names == ["01_quickstart", "02_train_layer", "03_inference", "04_benchmarks", "05_qwen3_5"]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, monkeypatch, tmp_path):
  nb = nbformat.read(path, as_version=4)
  first = nb.cells[0]
  assert first.cell_type == "markdown" and "colab.research.google.com/github/" in first.source
  assert f"notebooks/{path.name}" in first.source, "the Colab badge points at another notebook"
  install = nb.cells[1]
  assert install.cell_type == "code" and "import gdp_jax" in install.source
  assert "except ImportError" in install.source, "the install cell must be a no-op when installed"

  # The kernel is this interpreter (the .venv with gdp_jax installed), whatever kernels the
  # machine's Jupyter knows: a kernel spec of our own, first on JUPYTER_PATH.
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gdp-jax tests",
        "language": "python",
      }
    )
  )
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  # The kernel inherits this environment: CPU, quiet, the smoke sizes.
  monkeypatch.setenv("GDP_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  monkeypatch.setenv("PYTHONWARNINGS", "ignore::DeprecationWarning")
  client = nbclient.NotebookClient(
    nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL, resources={"metadata": {"path": str(NOTEBOOKS)}}
  )
  t0 = time.perf_counter()
  client.execute()
  print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors, errors
