"""The measured tables: launch parameters and thresholds that sweeps on one device kind chose,
read from `pallas_kernels/<backend>/tuning/<kind>.json` (each entry with its command, date and
result file in benchmarks/results/). The heuristics read them here; no measured number lives in
the code (docs/kernels.md)."""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@functools.cache
def table(backend: str = "triton", kind: str = "h200") -> dict[str, Any]:
  """The whole table of `kind` for `backend` (a dict, as in the JSON file)."""
  path = _ROOT / backend / "tuning" / f"{kind}.json"
  if not path.is_file():
    raise ValueError(f"no tuning table for {backend!r} on {kind!r}: {path} does not exist")
  return json.loads(path.read_text())


def value(key: str, backend: str = "triton", kind: str = "h200") -> Any:
  """The value of one entry (e.g. "step_max_state")."""
  return table(backend, kind)[key]["value"]


def launch(kernel: str, backend: str = "triton", kind: str = "h200") -> dict[str, int]:
  """The measured launch parameters of `kernel` (a dict of keyword arguments)."""
  return dict(table(backend, kind)["launches"][kernel]["value"])
