"""The package's command line: `python -m gdp_jax check` (the operator forward and backward
against the recurrent reference) and `python -m gdp_jax info` (versions, the device and the
implementation each op picks there; docs/implementations.md#choosing-an-implementation).

It runs only what the package holds. The lab lives in a checkout and runs from there by its own
entry points (README.md): `python -m examples.s3_demo` (`make demo`), `python -m examples.byte_lm`
(docs/train_lm.md) and `python -m benchmarks.bench`.
"""

from __future__ import annotations

import argparse
import sys
import time

from gdp_jax.ops.gated_delta_product.api import IMPLEMENTATIONS

LAB = (
  "the lab runs from a checkout of the repository: python -m examples.s3_demo (make demo), "
  "python -m examples.byte_lm (a byte-level LM) and python -m benchmarks.bench"
)


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


def info(args) -> int:
  """Versions, the default device and the implementation `None` picks there for each op."""
  import jax

  import gdp_jax
  from gdp_jax.ops.gated_delta_product.api import REGISTRY, describe_runtime
  from gdp_jax.ops.gqa_decode.api import REGISTRY as DECODE_REGISTRY
  from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY

  print(f"gdp-jax {gdp_jax.__version__}, jax {jax.__version__}")
  print(describe_runtime())
  for name, registry in (
    ("gated_delta_product", REGISTRY),
    ("gated_delta_product_step", STEP_REGISTRY),
    ("gqa_decode", DECODE_REGISTRY),
  ):
    print(f"{name}: implementation=None runs {registry.resolve(None).name!r}")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m gdp_jax", epilog=LAB)
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser(
    "check",
    help="run the operator forward and backward under jax.jit and check both against the "
    "recurrent reference",
  )
  p.add_argument("--implementation", default=None, choices=list(IMPLEMENTATIONS))
  p.set_defaults(func=check)
  p = sub.add_parser("info", help="versions, the device and the implementation each op picks")
  p.set_defaults(func=info)
  args = parser.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
