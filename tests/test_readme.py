"""README.md holds its promises: every ```python block runs on its own (a fresh interpreter: its
imports and inputs included), and the commands of its ```bash blocks name make targets, scripts,
files and `python -m` commands that exist, and its "Two commands" are two: `make demo` (the main
job, `python -m examples.s3_demo`) and `make test`.

The blocks run on the CPU as a user without a GPU would run them: one device (the sharding
example asks for its 8 simulated devices itself; 8 for every block made each compile dearer).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
BASH_BLOCKS = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)


def first_code_line(block):
  return next(
    line for line in block.splitlines() if line and not line.startswith(("#", "import", "from"))
  )


def test_readme_has_its_examples():
  assert len(PYTHON_BLOCKS) >= 5, len(PYTHON_BLOCKS)


def test_readme_is_a_front_page():
  """At most 300 lines; the dated run history lives in docs/performance.md, the releases in
  CHANGELOG.md; the implementations are listed in one table (tests/test_layout.py checks it
  against the dispatch table)."""
  assert len(README.splitlines()) <= 300, len(README.splitlines())


@pytest.mark.parametrize(
  "block", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))]
)
def test_python_block_runs_on_its_own(block):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=str(ROOT),
    PYTHONWARNINGS="ignore::DeprecationWarning",
  )
  out = subprocess.run(
    [sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, (
    f"README block starting {first_code_line(block)!r} failed:\n{out.stderr[-3000:]}"
  )


def _bash_lines():
  for block in BASH_BLOCKS:
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
      line = line.split("#")[0].strip()
      if line:
        yield line


def test_bash_commands_name_what_exists():
  makefile = (ROOT / "Makefile").read_text()
  targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
  from gdp_jax.__main__ import main

  lines = list(_bash_lines()) + re.findall(r"`([^`]*python -m [^`]*)`", README)
  assert lines
  for line in lines:
    for target in re.findall(r"\bmake ([\w-]+)", line):
      assert target in targets, f"README runs `make {target}`, the Makefile has {targets}"
    for path in re.findall(r"(?:^|\s)((?:scripts|benchmarks)/[\w./-]+)", line):
      assert (ROOT / path).exists(), f"README names {path}, which does not exist"
    for commands in re.findall(r"python -m gdp_jax ([\w|-]+)", line):
      for command in commands.split("|"):
        with pytest.raises(SystemExit) as info:
          main([command, "--help"])
        assert info.value.code == 0, f"`python -m gdp_jax {command}` is no command"
    for module in re.findall(r"python -m ((?:examples|benchmarks)[\w.]*)", line):
      path = ROOT / module.replace(".", "/")
      assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module
    assert "/root/" not in line and "/work/" not in line, f"a machine path in {line!r}"


def test_two_commands_are_two():
  section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
  block = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)[0]
  commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
  assert commands == ["make demo", "make test"], commands
  makefile = (ROOT / "Makefile").read_text()
  demo = re.search(r"^demo:.*\n\t(.*)", makefile, re.M)
  assert demo and demo.group(1) == "$(PY) -m examples.s3_demo", makefile
