"""The layout's rules (docs/implementations.md#layout): imports run one way, and the dispatch
table, the README's implementation table and docs/implementations.md name the same
implementations."""

from __future__ import annotations

import ast
import pathlib
import re

from gdp_jax.ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The public API modules: the package itself and each op's api.py.
API_MODULES = re.compile(r"^gdp_jax(\.ops\.\w+\.api)?$")


def _imports(path: pathlib.Path) -> list[str]:
  """Every module `path` imports (absolute names; `from a import b` gives a and a.b)."""
  names = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.append(node.module)
      names += [f"{node.module}.{alias.name}" for alias in node.names]
  return names


def test_kernels_never_import_the_package():
  files = sorted((ROOT / "pallas_kernels").rglob("*.py"))
  assert len(files) > 10, files  # the walk found the kernels
  bad = {
    str(f.relative_to(ROOT)): name
    for f in files
    for name in _imports(f)
    if name == "gdp_jax" or name.startswith("gdp_jax.")
  }
  assert not bad, bad


def test_implementations_never_import_an_api_module():
  files = [f for f in sorted((ROOT / "gdp_jax" / "ops").rglob("*.py")) if f.name != "api.py"]
  assert any(f.name == "triton.py" for f in files), files
  bad = {
    str(f.relative_to(ROOT)): name for f in files for name in _imports(f) if API_MODULES.match(name)
  }
  assert not bad, bad


def test_the_rule_catches_an_api_import():
  # the check above can fail: an implementation importing the public operator would be caught
  assert API_MODULES.match("gdp_jax.ops.gated_delta_product.api")
  assert API_MODULES.match("gdp_jax")
  assert not API_MODULES.match("gdp_jax.ops.validation")


# ---- the implementation tables ----------------------------------------------------------------
#
# README.md and docs/implementations.md each hold one table between the lines
#   <!-- implementations: begin -->   and   <!-- implementations: end -->
# whose first column names an implementation in backticks and double quotes (| `"xla"` | ...):
# every backend of the dispatch table, plus "pallas".

BEGIN, END = "<!-- implementations: begin -->", "<!-- implementations: end -->"


def _listed(text: str) -> list[str] | None:
  if BEGIN not in text:
    return None
  block = text.split(BEGIN, 1)[1].split(END, 1)[0]
  return re.findall(r'^\|\s*`"(\w+)"`', block, flags=re.M)


def _table_names() -> list[str]:
  names: list[str] = []
  for function in dispatch.TABLE:
    names += [n for n in dispatch.implementations(function) if n not in names]
  return names


def test_docs_list_the_dispatch_table():
  listed = _listed((ROOT / "docs" / "implementations.md").read_text())
  assert listed is not None, f"docs/implementations.md has no {BEGIN} table"
  assert sorted(listed) == sorted(_table_names()), (listed, _table_names())


def test_readme_lists_the_dispatch_table():
  # The README's "## Implementations" section: a table whose first column names each one.
  section = (ROOT / "README.md").read_text().split("## Implementations\n", 1)[1]
  listed = re.findall(r"^\| `(\w+)` \|", section.split("\n## ", 1)[0], flags=re.M)
  assert sorted(listed) == sorted(_table_names()), (listed, _table_names())


def test_listed_reads_the_marked_table_only():
  text = f'| `"elsewhere"` |\n{BEGIN}\n| name | what |\n| --- | --- |\n| `"xla"` | jnp |\n{END}\n'
  assert _listed(text) == ["xla"]
  assert _listed("no table") is None
