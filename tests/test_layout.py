"""The layout's rules (docs/implementations.md#layout): imports run one way, no private name
crosses modules of the ops, a Hopper call crosses few modules, and the registries, the README's
implementation table and docs/implementations.md name the same implementations."""

from __future__ import annotations

import ast
import pathlib
import re

from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.gqa_decode.api import PAGED_REGISTRY
from gdp_jax.ops.gqa_decode.api import REGISTRY as DECODE_REGISTRY
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY

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


def _module(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _ops_files():
  return sorted((ROOT / "gdp_jax" / "ops").rglob("*.py"))


def test_only_api_modules_import_the_registry():
  # the registry sits above the implementations: only each op's api.py builds one
  bad = {
    _module(f): name
    for f in _ops_files()
    for name in _imports(f)
    if name == "gdp_jax.ops.registry" and f.name != "api.py"
  }
  assert not bad, bad


def _private_imports(path: pathlib.Path) -> list[str]:
  """`from gdp_jax.x import _name` in `path`: a private name taken from another module."""
  names = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gdp_jax"):
      names += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
  return names


def test_no_private_name_crosses_modules_of_the_ops():
  bad = {_module(f): n for f in _ops_files() for n in _private_imports(f)}
  assert not bad, bad
  # the check can fail
  probe = ROOT / "gdp_jax" / "ops" / "gated_delta_product" / "xla_backward.py"
  assert not _private_imports(probe)
  text = "from gdp_jax.ops.gated_delta_product.xla import _helper\n"
  assert _private_imports_of(text) == ["gdp_jax.ops.gated_delta_product.xla._helper"]


def _private_imports_of(text: str) -> list[str]:
  import tempfile

  with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
    f.write(text)
    f.flush()
    return _private_imports(pathlib.Path(f.name))


def _package_imports(module: str) -> set[str]:
  """The modules of gdp_jax and pallas_kernels that `module` imports (its file's imports)."""
  path = ROOT / (module.replace(".", "/") + ".py")
  if not path.exists():
    path = ROOT / module.replace(".", "/") / "__init__.py"
  found = set()
  for name in _imports(path):
    while name and not (ROOT / (name.replace(".", "/") + ".py")).exists():
      name = name.rpartition(".")[0]
    if name.startswith(("gdp_jax", "pallas_kernels")):
      found.add(name)
  return found


def _shortest_chain(start: str, goal) -> list[str] | None:
  """The fewest modules from `start` to one for which `goal(module)` holds, by their imports."""
  chains = {start: [start]}
  frontier = [start]
  while frontier:
    nxt = []
    for module in frontier:
      if goal(module):
        return chains[module]
      for name in sorted(_package_imports(module)):
        if name not in chains:
          chains[name] = chains[module] + [name]
          nxt.append(name)
    frontier = nxt
  return None


def _calls_plgpu_kernel(module: str) -> bool:
  path = ROOT / (module.replace(".", "/") + ".py")
  return path.exists() and "plgpu.kernel(" in path.read_text()


def test_a_hopper_call_crosses_few_modules():
  # from the public operator to a Mosaic GPU kernel launch (`plgpu.kernel`): at most 8 modules
  chain = _shortest_chain("gdp_jax.ops.gated_delta_product.api", _calls_plgpu_kernel)
  assert chain is not None and len(chain) <= 8, chain
  mosaic = "gdp_jax.ops.gated_delta_product.mosaic_gpu"
  assert not any(".triton" in m for m in _package_imports(mosaic)), _package_imports(mosaic)


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
# every implementation of the registries, plus "pallas".

BEGIN, END = "<!-- implementations: begin -->", "<!-- implementations: end -->"


def _listed(text: str) -> list[str] | None:
  if BEGIN not in text:
    return None
  block = text.split(BEGIN, 1)[1].split(END, 1)[0]
  return re.findall(r'^\|\s*`"(\w+)"`', block, flags=re.M)


def _table_names() -> list[str]:
  names: list[str] = []
  for registry in (REGISTRY, STEP_REGISTRY, DECODE_REGISTRY, PAGED_REGISTRY):
    names += [n for n in registry.accepted() if n not in names]
  return names


def test_docs_list_the_registries():
  listed = _listed((ROOT / "docs" / "implementations.md").read_text())
  assert listed is not None, f"docs/implementations.md has no {BEGIN} table"
  assert sorted(listed) == sorted(_table_names()), (listed, _table_names())


def test_readme_lists_the_registries():
  # The README's "## Implementations" section: a table whose first column names each one.
  section = (ROOT / "README.md").read_text().split("## Implementations\n", 1)[1]
  listed = re.findall(r"^\| `(\w+)` \|", section.split("\n## ", 1)[0], flags=re.M)
  assert sorted(listed) == sorted(_table_names()), (listed, _table_names())


def test_listed_reads_the_marked_table_only():
  text = f'| `"elsewhere"` |\n{BEGIN}\n| name | what |\n| --- | --- |\n| `"xla"` | jnp |\n{END}\n'
  assert _listed(text) == ["xla"]
  assert _listed("no table") is None


# ---- file sizes and module docstrings ------------------------------------------------------------
#
# No package file over 500 lines; a module docstring of at most 15 lines saying what the module is
# for (history goes to CHANGELOG.md and docs/, timings to benchmarks/results/).
MAX_LINES, MAX_DOCSTRING_LINES = 500, 15


def _docstring_lines(text: str) -> int:
  body = ast.parse(text).body
  first = body[0] if body else None
  if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
    if isinstance(first.value.value, str):
      return first.end_lineno - first.lineno + 1
  return 0


def _too_long(paths) -> list[str]:
  bad = []
  for path in paths:
    name = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    if len(text.splitlines()) > MAX_LINES:
      bad.append(f"{name}: {len(text.splitlines())} lines")
    if _docstring_lines(text) > MAX_DOCSTRING_LINES:
      bad.append(f"{name}: a {_docstring_lines(text)}-line module docstring")
  return bad


def test_package_files_are_short_and_say_what_they_are_for():
  paths = sorted([*(ROOT / "gdp_jax").rglob("*.py"), *(ROOT / "pallas_kernels").rglob("*.py")])
  assert len(paths) > 50, paths
  assert _too_long(paths) == []
  # the check can fail
  assert _docstring_lines('"""one\n\ntwo"""\nx = 1\n') == 3
  assert _docstring_lines("x = 1\n") == 0
