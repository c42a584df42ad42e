"""The public surface: one float64 policy everywhere, clear errors for the derivatives the Pallas
implementations do not have, type annotations and docstrings on the public API, the submodules
reachable from `import gdp_jax`, `make gpu-check` a real rule, and a test extra that lists what
the tests and notebooks import."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import pathlib
import pydoc
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax import gated_delta_product, gated_delta_product_step, gqa_decode, layers, models
from tests.cases import make_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- float64: rejected by every public function (everything is computed in float32) ----------


def _operator_inputs():
  return make_inputs(50, B=1, T=4, H=2, K=8, V=4, r=2, mask_kind="head")


@pytest.mark.parametrize("name", ["q", "g", "beta", "mask", "initial_state"])
@pytest.mark.parametrize("implementation", ["reference", "xla", "pallas"])
def test_float64_operator_inputs_are_rejected(name, implementation):
  with jax.enable_x64(True):
    inputs = _operator_inputs()
    names = ("q", "k", "v") if name == "q" else (name,)
    inputs.update({n: inputs[n].astype(jnp.float64) for n in names})
    with pytest.raises(TypeError, match=f"{name} is float64 .*cast it to float32"):
      gated_delta_product(**inputs, implementation=implementation)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_float64_step_and_decode_inputs_are_rejected(implementation):
  with jax.enable_x64(True):
    f64 = lambda *shape: jnp.ones(shape, jnp.float64)
    with pytest.raises(TypeError, match="q is float64"):
      gated_delta_product_step(
        f64(1, 2, 8),
        f64(1, 2, 8),
        f64(1, 2, 4),
        None,
        jnp.ones((1, 2), jnp.float32),
        implementation=implementation,
      )
    with pytest.raises(TypeError, match="state is float64"):
      ones = jnp.ones((1, 2, 8), jnp.float32)
      gated_delta_product_step(
        ones,
        ones,
        ones[..., :4],
        None,
        jnp.ones((1, 2), jnp.float32),
        state=f64(1, 2, 8, 4),
        implementation=implementation,
      )
    cache = jnp.ones((1, 8, 1, 4), jnp.float32)
    with pytest.raises(TypeError, match="query is float64"):
      gqa_decode(f64(1, 2, 4), cache, cache, jnp.array([3]), implementation=implementation)
    with pytest.raises(TypeError, match="key_cache is float64"):
      gqa_decode(
        jnp.ones((1, 2, 4), jnp.float32),
        f64(1, 8, 1, 4),
        f64(1, 8, 1, 4),
        jnp.array([3]),
        implementation=implementation,
      )


def test_float64_numpy_without_x64_is_float32():
  """Without x64, JAX makes float64 NumPy arrays float32: accepted, computed as float32."""
  inputs = {
    n: (None if x is None else np.asarray(x, np.float64)) for n, x in _operator_inputs().items()
  }
  # jitted, the arrays closed over (the function gets them as NumPy float64, as eagerly): one
  # compile instead of one per operation
  o, _ = jax.jit(lambda: gated_delta_product(**inputs, implementation="xla"))()
  assert o.dtype == jnp.float32


# ---- derivatives the Pallas implementations do not have: clear errors -------------------------


def _pallas_loss(q, inputs):
  o, _ = gated_delta_product(
    q, *(inputs[n] for n in ("k", "v", "g", "beta", "mask")), implementation="pallas"
  )
  return jnp.sum(o * o)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "grad of grad"])
def test_pallas_forward_mode_and_second_order_are_clear_errors(transform):
  inputs = _operator_inputs()
  q = inputs["q"]
  loss = lambda q: _pallas_loss(q, inputs)
  # under jit: the error comes while tracing, before anything compiles or runs
  run = {
    "jvp": lambda: jax.jit(lambda q: jax.jvp(loss, (q,), (q,)))(q),
    "jacfwd": lambda: jax.jit(jax.jacfwd(loss))(q),
    "grad of grad": lambda: jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2)))(q),
  }
  with pytest.raises(
    NotImplementedError,
    match="implementation='pallas' supports reverse-mode first derivatives "
    "only.*need implementation='xla'",
  ):
    run[transform]()


@pytest.mark.parametrize("operator", ["gated_delta_product", "householder_delta_product"])
def test_mosaic_gpu_forward_mode_is_a_clear_error_while_tracing(operator):
  # jax.jvp of a custom_vjp under jax.jit would fail only when lowered, with JAX's own TypeError;
  # traced here with abstract inputs at a shape the Mosaic kernels take (nothing lowers or runs)
  spec, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  n_h = 2 if operator == "householder_delta_product" else 1
  kw = dict(num_householder=n_h) if n_h > 1 else {}
  function = getattr(gdp_jax, operator)

  def forward_mode(q, k, g, beta):
    loss = lambda q: jnp.sum(function(q, k, k, g, beta, implementation="mosaic_gpu", **kw)[0])
    return jax.jvp(loss, (q,), (q,))

  q, k = spec((1, 64, 2, 64), bf16), spec((1, 64 * n_h, 2, 64), bf16)
  g, beta = spec((1, 64, 2), jnp.float32), spec((1, 64 * n_h, 2), jnp.float32)
  with pytest.raises(NotImplementedError, match="supports reverse-mode first derivatives only"):
    jax.jit(forward_mode).trace(q, k, g, beta)


def test_xla_supports_forward_mode_and_second_order():
  inputs = _operator_inputs()
  loss = lambda q: jnp.sum(
    gated_delta_product(
      q, *(inputs[n] for n in ("k", "v", "g", "beta", "mask")), implementation="xla"
    )[0]
    ** 2
  )
  # under jit: one compilation each instead of op-by-op dispatch of the chunked form
  _, tangent = jax.jit(lambda q: jax.jvp(loss, (q,), (q,)))(inputs["q"])
  grad = jax.jit(jax.grad(loss))(inputs["q"])
  np.testing.assert_allclose(float(tangent), float(jnp.sum(grad * inputs["q"])), rtol=1e-4)
  assert np.isfinite(float(jax.jit(jax.hessian(lambda s: loss(s * inputs["q"])))(1.0)))


def test_pallas_decode_steps_have_no_gradient_and_say_so():
  q = jnp.ones((2, 2, 8)) / 4
  beta = jnp.full((2, 2), 0.5)
  with pytest.raises(
    NotImplementedError,
    match="gated_delta_product_step with "
    "implementation='pallas' has no derivatives.*use implementation='xla'",
  ):
    jax.grad(
      lambda q: jnp.sum(gated_delta_product_step(q, q, q, None, beta, implementation="pallas")[0])
    )(q)
  cache = jnp.ones((2, 16, 1, 8))
  with pytest.raises(
    NotImplementedError,
    match="gqa_decode with implementation='pallas' has no derivatives.*use implementation='xla'",
  ):
    jax.grad(
      lambda q: jnp.sum(gqa_decode(q, cache, cache, jnp.array([3, 9]), implementation="pallas"))
    )(q)
  # the jnp versions are differentiable
  jax.grad(lambda q: jnp.sum(gqa_decode(q, cache, cache, jnp.array([3, 9]), implementation="xla")))(
    q
  )


# ---- annotations, docstrings, reachability ----------------------------------------------------

PUBLIC_FUNCTIONS = [gated_delta_product, gated_delta_product_step, gqa_decode, models.generate]
PUBLIC_CLASSES = {
  layers.GatedDeltaProduct: ("__init__", "__call__", "step", "init_cache"),
  layers.HouseholderDeltaProduct: ("__init__", "__call__", "step", "init_cache"),
  layers.GroupedQueryAttention: ("__init__", "__call__", "step", "init_cache"),
  models.HybridLM: ("__init__", "__call__", "prefill", "step", "init_cache"),
}


def _public_callables():
  for fn in PUBLIC_FUNCTIONS:
    yield fn.__qualname__, fn
  for cls, methods in PUBLIC_CLASSES.items():
    yield cls.__qualname__, cls
    for m in methods:
      yield f"{cls.__qualname__}.{m}", getattr(cls, m)


@pytest.mark.parametrize(
  "name,obj", list(_public_callables()), ids=[n for n, _ in _public_callables()]
)
def test_public_api_is_annotated_and_documented(name, obj):
  doc = inspect.getdoc(obj)
  assert doc and len(doc) > 20, f"{name} has no docstring"
  rendered = pydoc.render_doc(obj, renderer=pydoc.plaintext)
  assert doc.splitlines()[0].strip() in rendered, f"help({name}) does not show its docstring"
  if inspect.isclass(obj):
    return
  signature = inspect.signature(obj)
  missing = [
    p.name
    for p in signature.parameters.values()
    if p.name != "self" and p.annotation is inspect.Parameter.empty
  ]
  assert not missing, f"{name}: parameters without a type annotation: {missing}"
  if not name.endswith("__init__"):
    assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return type"


def test_submodules_reachable_after_import_gdp_jax():
  code = (
    "import gdp_jax; print(gdp_jax.layers.GatedDeltaProduct.__name__, "
    "gdp_jax.models.HybridLM.__name__, gdp_jax.sharding.ShardingConfig.__name__)"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["GatedDeltaProduct", "HybridLM", "ShardingConfig"]
  assert "layers" in dir(gdp_jax)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    _ = gdp_jax.nope


# ---- make gpu-check, the test extra ------------------------------------------------------------


def test_make_gpu_check_runs_the_gpu_script():
  """`make gpu-check` is a real rule (it used to print "Nothing to be done"): a dry run shows it
  calling scripts/gpu_check.sh with the sections asked for."""
  out = subprocess.run(
    ["make", "-n", "gpu-check", "SECTIONS=tests decode"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr
  assert "Nothing to be done" not in out.stdout + out.stderr
  assert re.search(r"scripts/gpu_check\.sh tests decode", out.stdout), out.stdout


def _imports(source):
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


def _normalise(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def _extra(project, name):
  """The requirements of an extra, with the project's own extras it names (`gdp-jax[a,b]`)
  expanded."""
  out = []
  for requirement in project["optional-dependencies"][name]:
    own = re.fullmatch(r"gdp-jax\[([\w,\s-]+)\]", requirement)
    if own:
      for extra in own.group(1).split(","):
        out += _extra(project, extra.strip())
    else:
      out.append(requirement)
  return out


def test_core_dependencies_are_the_library_only():
  """The package needs jax, numpy, flax (and absl-py, which it imports); the lab's tools are
  extras, and nothing under gdp_jax/ or pallas_kernels/ imports them."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  core = {_normalise(re.split(r"[<>=!~;\[ ]", d)[0]) for d in project["dependencies"]}
  assert core == {"jax", "numpy", "flax", "absl-py"}, core
  lab = {"optax", "orbax", "tqdm", "matplotlib", "torch", "fla", "jla", "triton"}
  for folder in ("gdp_jax", "pallas_kernels"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      used = _imports(path.read_text()) & lab
      assert not used, f"{path.relative_to(ROOT)} imports {sorted(used)}: an extra's package"
  for extra in ("examples", "bench", "test"):
    assert extra in project["optional-dependencies"], extra
  assert {"optax", "orbax-checkpoint", "tqdm"} <= {_normalise(d) for d in _extra(project, "test")}


def test_test_extra_lists_what_the_tests_import():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  declared = {
    _normalise(re.split(r"[<>=!~;\[ ]", d)[0])
    for d in project["dependencies"] + _extra(project, "test")
  }
  modules = set()
  for path in (ROOT / "tests").glob("*.py"):
    modules |= _imports(path.read_text())
  for path in (ROOT / "notebooks").glob("*.ipynb"):
    for cell in json.loads(path.read_text())["cells"]:
      if cell["cell_type"] == "code":
        code = "".join(cell["source"])
        code = "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!")))
        modules |= _imports(code)
  local = {"gdp_jax", "pallas_kernels", "tests", "benchmarks", "scripts", "examples"}
  third_party = {m for m in modules if m not in sys.stdlib_module_names and m not in local}
  providers = importlib.metadata.packages_distributions()
  missing = []
  for module in sorted(third_party):
    dists = {_normalise(d) for d in providers.get(module, [module])}
    if not dists & declared and not (module == "jaxlib" and "jax" in declared):
      missing.append(f"{module} ({', '.join(sorted(dists))})")
  assert not missing, f"imported by tests or notebooks but not declared: {missing}"
  # pytest's -n (make test) needs pytest-xdist; the notebooks run on ipykernel with nbclient.
  for needed in ("pytest", "pytest-xdist", "nbclient", "nbformat", "ipykernel"):
    assert needed in declared, needed
