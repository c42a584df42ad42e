"""The repository speaks only of itself: the README, docs/, the changelog, the notebooks and the
kept results (benchmarks/results/) hold no words about how the project was developed and no
absolute paths of the machines it ran on; kept results carry their date, jax version, GPU and a
command relative to the repository. Also: the slow tier's list (tests/conftest.py) names tests
that exist, and the two make targets run the two tiers.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import FAST_CASES, LONGEST_FIRST, SLOW, SPLIT

ROOT = pathlib.Path(__file__).resolve().parents[1]

# How the project was developed: rounds of work and the limits of the machines that ran it.
DEVELOPMENT_WORDS = re.compile(
  r"\bwaves?\b|\bsessions?\b|\bthe run's (?:time )?limit\b"
  r"|\bcut by (?:its|the run's) (?:time )?limit\b"
  r"|\btime limits? of the machine\b|\bthe command's \d+ s limit\b",
  re.IGNORECASE,
)
# Absolute paths of a machine (Colab's /content and the /tmp defaults of scripts are not).
MACHINE_PATHS = re.compile(r"(?<![\w.~-])/(?:opt|usr|work|root|home|Users|mnt|scratch)/[\w.+-]")


def text_files():
  paths = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
  paths += sorted((ROOT / "docs").rglob("*.md"))
  paths += sorted((ROOT / "notebooks").glob("*.ipynb"))
  paths += sorted(p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file())
  return [p for p in paths if p.suffix in (".md", ".ipynb", ".json", ".txt", ".csv")]


def problems(text: str) -> list[str]:
  """The development words and machine paths in `text`, each with a little context."""
  found = []
  for pattern in (DEVELOPMENT_WORDS, MACHINE_PATHS):
    for m in pattern.finditer(text):
      found.append(repr(text[max(0, m.start() - 40) : m.end() + 40]))
  return found


def test_the_check_finds_planted_examples():
  planted = [
    "The fused forward (wave 2) was faster.",
    "Measured in session 3.",
    "the run's limit cut jax-linear-attention's forward + backward",
    "the sweep was cut by its time limit at r = 2",
    'File "/opt/torch/.venv/lib/python3.12/site-packages/jax/_src/core.py", line 1',
    '"root": "/usr/lib/python3.12"',
    "see /work/main/README.md",
  ]
  for text in planted:
    assert problems(text), text
  clean = [
    "python benchmarks/bench_varlen.py --time-limit 120",
    "results in /tmp/gdp_gpu_out",
    'pathlib.Path("/content/gdp-jax/benchmarks/results")',
    "the state walks limit the forward; a job's time limit",
  ]
  for text in clean:
    assert not problems(text), text


def test_files_are_checked():
  names = {p.relative_to(ROOT).as_posix() for p in text_files()}
  assert "README.md" in names and "CHANGELOG.md" in names and "docs/performance.md" in names
  assert any(n.startswith("notebooks/") for n in names)
  assert sum(n.startswith("benchmarks/results/") and n.endswith(".json") for n in names) > 10


@pytest.mark.parametrize("path", text_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_development_words_or_machine_paths(path):
  found = problems(path.read_text(errors="replace"))
  assert not found, f"{path.relative_to(ROOT)}: {found[:5]}"


def _kept_json():
  return sorted((ROOT / "benchmarks" / "results").rglob("*.json"))


@pytest.mark.parametrize("path", _kept_json(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_kept_results_carry_their_provenance(path):
  res = json.loads(path.read_text())
  env = res.get("env") if isinstance(res.get("env"), dict) else {}
  date = res.get("date") or res.get("started") or res.get("created") or env.get("date")
  assert date and re.match(r"20\d\d-\d\d-\d\d", str(date)), f"{path.name}: no date"
  jax_version = res.get("jax_version") or res.get("jax") or (res.get("env") or {}).get("jax")
  assert jax_version, f"{path.name}: no jax version"
  gpu = json.dumps(
    {k: res.get(k) for k in ("device_kind", "device", "gpu", "gpu_name", "env", "backend")}
  )
  assert "H200" in gpu or "h200" in path.name, f"{path.name}: no GPU named"
  command = res.get("command") or env.get("command")
  assert command, f"{path.name}: no command"
  assert not MACHINE_PATHS.search(str(command)), f"{path.name}: {command!r}"


def _test_functions():
  names = set()
  for path in (ROOT / "tests").glob("test_*.py"):
    body = ast.parse(path.read_text()).body
    classes = {node.name: node for node in body if isinstance(node, ast.ClassDef)}

    def methods(cls):  # its own test methods and those of its base classes in the same file
      own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
      for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
          own |= methods(classes[base.id])
      return own

    for node in body:
      if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
        names.add(f"tests/{path.name}::{node.name}")
      elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
        for method in methods(node):
          if method.startswith("test"):
            names.add(f"tests/{path.name}::{node.name}::{method}")
  return names


def test_every_slow_and_scheduling_pattern_names_a_test():
  tests = _test_functions()
  for name, patterns in (
    ("SLOW", SLOW),
    ("FAST_CASES", FAST_CASES),
    ("LONGEST_FIRST", LONGEST_FIRST),
  ):
    for pattern in patterns:
      base = pattern.split("[")[0].rstrip("*")
      assert any(t.startswith(base) for t in tests), f"{name} names no test: {pattern}"
  for path in SPLIT:
    assert (ROOT / path).is_file(), f"SPLIT names no file: {path}"


def unmatched_patterns(patterns, node_ids):
  """The patterns (tests/conftest.py's form) that match none of `node_ids`."""
  from tests.conftest import _path_id, _pattern

  ids = [_path_id(i) for i in node_ids]
  return [p for p in patterns if not any(_pattern([p]).fullmatch(i) for i in ids)]


def collected_node_ids(request) -> list[str]:
  """The node ids of the whole suite: this session's when it collected everything (no -m, -k
  or file selection: `make test`), else those of `pytest --collect-only` in a subprocess (a few
  seconds: the fast tier and a single file run it too)."""
  ids = [item.nodeid for item in request.session.items]
  files = {i.replace("\\", "/").split("::")[0] for i in ids}
  on_disk = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
  options = request.config.option
  if not (options.markexpr or options.keyword or files != on_disk):
    return ids
  command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
  done = subprocess.run(command + ["tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return [line for line in done.stdout.splitlines() if line.startswith("tests/") and "::" in line]


def test_every_slow_pattern_matches_a_collected_test(request):
  """Every SLOW, LONGEST_FIRST and FAST_CASES pattern matches a test of the whole suite: a
  renamed parameter (an implementation's id) leaves a pattern matching nothing, and its tests
  in the fast tier."""
  ids = collected_node_ids(request)
  assert len(ids) > 100, ids
  assert unmatched_patterns(SLOW, ids) == [], "SLOW patterns that match no test"
  assert unmatched_patterns(LONGEST_FIRST, ids) == [], "LONGEST_FIRST patterns that match no test"
  assert unmatched_patterns(FAST_CASES, ids) == [], "FAST_CASES patterns that match no test"
  assert unmatched_patterns(["tests/test_operator.py::test_jit_and_vmap[x*"], ids)  # can fail


def test_slow_patterns_match_node_ids():
  from tests.conftest import is_slow

  assert is_slow("tests/test_notebooks.py::test_notebook_runs[01_quickstart]")
  assert is_slow("tests/test_nonfinite.py::test_reset_matches_reference[triton]")
  assert not is_slow("tests/test_nonfinite.py::test_reset_matches_reference[xla]")
  assert not is_slow("tests/test_operator.py::test_jit_and_vmap")
  # FAST_CASES: a listed test's other cases are slow, a test not listed keeps every case fast
  assert not is_slow("tests/test_step.py::test_steps_match_operator[token-2-xla]")
  assert is_slow("tests/test_step.py::test_steps_match_operator[head-2-xla]")
  assert not is_slow("tests/test_step.py::test_pallas_in_a_jitted_scan[True]")


def test_make_targets_run_the_tiers():
  makefile = (ROOT / "Makefile").read_text()
  fast = re.search(r"^test-fast:.*\n\t(.*)", makefile, re.M)
  full = re.search(r"^test:.*\n\t(.*)", makefile, re.M)
  assert fast and '-m "not slow"' in fast.group(1), makefile
  assert full and "slow" not in full.group(1) and full.group(1).endswith(" tests"), makefile
  # both take units of tests longest first (tests/conftest.py, UnitScheduling)
  assert "$(XDIST)" in fast.group(1) and "$(XDIST)" in full.group(1), makefile
  assert "XDIST := -n 2 --dist loadfile --no-loadscope-reorder" in makefile, makefile


def test_units_start_longest_first():
  from tests.conftest import start_rank

  group = LONGEST_FIRST.index("tests/test_sharding.py::test_sharding_group*")
  assert start_rank("tests/test_sharding.py::test_sharding_group[pallas_model_bench]") == group
  assert start_rank("tests/test_varlen.py::test_layout_tables") == 0
  assert start_rank("tests/test_sharding.py::test_every_group_runs") == len(LONGEST_FIRST)
  assert 0 < start_rank("tests/test_householder.py::test_bad_inputs_raise[x]") < len(LONGEST_FIRST)
