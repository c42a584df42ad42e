"""Command line: `python -m gdp_jax check` (the operator against the reference), and thin entry
points into the lab kept outside the package in a checkout: `demo` (the main job,
examples/s3_demo), `train-lm` (examples/byte_lm) and `bench` (benchmarks/bench.py). Those three
need the checkout and an extra (`pip install -e ".[examples]"` or `".[bench]"`); without them the
command says what to install."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pathlib
import sys
import time

from gdp_jax.ops.gated_delta_product.api import IMPLEMENTATIONS

# The packages each extra brings that the lab modules import (matplotlib stays optional: the
# plots are skipped with a message without it).
EXTRA_PACKAGES = {"examples": ("optax", "orbax.checkpoint", "tqdm"), "bench": ("tqdm",)}

# command: (module in the checkout, the extra it needs, help, epilog)
LAB_COMMANDS = {
  "demo": (
    "examples.s3_demo.demo",
    "examples",
    "train small hybrid LMs on the S3 word problem (block mask, Gated DeltaNet, "
    "DeltaProduct), then generate",
    None,
  ),
  "bench": (
    "benchmarks.bench",
    "bench",
    "time the operator forward and forward + backward across implementations: "
    "table (ms, TFLOP/s, GB/s), JSON and PNG",
    None,
  ),
  "train-lm": (
    "examples.byte_lm.train_lm",
    "examples",
    "train a byte-level hybrid LM on the Python standard library: learning curves, tokens/s, "
    "MFU (JSON + PNG)",
    "presets, corpus and FLOP count: docs/train_lm.md",
  ),
}


def _checkout_root() -> pathlib.Path | None:
  """The repository holding this package when it runs from a checkout (it has examples/)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  return root if (root / "examples").is_dir() and (root / "benchmarks").is_dir() else None


def load_lab_module(command: str):
  """The module behind `command`, or a message saying what is missing (the checkout or an extra)."""
  module_name, extra, _, _ = LAB_COMMANDS[command]
  root = _checkout_root()
  if root is None:
    return None, (
      f"`python -m gdp_jax {command}` runs {module_name.replace('.', '/')}.py, which lives in the "
      "gdp-jax repository, not in the installed package: clone it and run the command there "
      f'(pip install -e ".[{extra}]")'
    )
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))

  def missing(name):
    return None, (
      f"`python -m gdp_jax {command}` needs {name!r}, from the `{extra}` extra: "
      f'pip install -e ".[{extra}]" (or pip install "gdp-jax[{extra}]")'
    )

  for package in EXTRA_PACKAGES[extra]:  # imported lazily by the module: check them up front
    try:
      found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
      found = False
    if not found:
      return missing(package)
  try:
    return importlib.import_module(module_name), None
  except ModuleNotFoundError as e:
    if e.name and e.name.split(".")[0] in ("examples", "benchmarks", "gdp_jax", "pallas_kernels"):
      raise
    return missing(e.name)


def check(args) -> int:
  """A small forward and gradient of the operator, checked against the recurrent reference."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from gdp_jax import gated_delta_product

  B, T, H, K, V, r = 2, 100, 4, 32, 32, 2
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = n(B, T, H, K), n(B, T, H, K), n(B, T, H, V)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g = -0.1 * jnp.abs(n(B, T, H))
  beta = jax.nn.sigmoid(n(B, T, H))
  mask = jnp.eye(r) * 0.5 + 0.5
  impl = args.implementation
  print(f"backend: {jax.default_backend()}; implementation: {impl or 'default'}")
  print(f"shapes: B={B} T={T} H={H} K={K} V={V} r={r}")

  def loss(q, k, v, impl):
    o, final = gated_delta_product(
      q, k, v, g, beta, mask, output_final_state=True, implementation=impl
    )
    return jnp.mean(o.astype(jnp.float32) ** 2) + jnp.mean(final**2)

  t0 = time.perf_counter()
  val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, impl)
  jax.block_until_ready(grads)
  dt = time.perf_counter() - t0
  ref_val, ref_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, "reference")
  worst = max(
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(grads, ref_grads)
  )
  print(f"loss {float(val):.6f} (reference {float(ref_val):.6f}); compiled + ran in {dt:.2f}s")
  print(f"largest relative gradient difference to the reference (dq, dk, dv): {worst:.2e}")
  ok = abs(float(val) - float(ref_val)) <= 1e-4 * abs(float(ref_val)) and worst < 1e-3
  print("check:", "OK" if ok else "MISMATCH")
  return 0 if ok else 1


def _missing(message):
  def report(args) -> int:
    print(message, file=sys.stderr)
    return 2

  return report


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m gdp_jax")
  sub = parser.add_subparsers(dest="command", required=True)
  commands = [*sys.argv[1:2]] if argv is None else [*argv[:1]]
  for name, (_, _, help_text, epilog) in LAB_COMMANDS.items():
    # Only the command that runs is imported (its extras); `--help` at the top lists them all.
    module, message = load_lab_module(name) if name in commands else (None, None)
    if module is not None:
      p = sub.add_parser(
        name, help=help_text, description=module.__doc__.split("\n\n")[0], epilog=epilog
      )
      module.add_arguments(p)
      p.set_defaults(func=module.run)
    else:
      p = sub.add_parser(name, help=help_text, epilog=epilog)
      p.set_defaults(func=_missing(message or ""), lab_missing=True)
    if name == "demo":
      p = sub.add_parser(
        "check",
        help="run the operator forward and backward under jax.jit and "
        "check both against the recurrent reference",
      )
      p.add_argument(
        "--implementation",
        default=None,
        choices=list(IMPLEMENTATIONS),
      )
      p.set_defaults(func=check)
  args, rest = parser.parse_known_args(argv)
  if rest and not getattr(args, "lab_missing", False):  # the missing command's flags are moot
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
