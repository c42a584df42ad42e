"""Command line: `python -m gdp_jax demo` (the main job), `python -m gdp_jax check` (the operator
against the reference), `python -m gdp_jax bench` and `python -m gdp_jax train-lm`."""

from __future__ import annotations

import argparse
import sys
import time


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m gdp_jax")
  sub = parser.add_subparsers(dest="command", required=True)
  from gdp_jax import demo, dispatch

  p = sub.add_parser(
    "demo",
    help="train a small hybrid LM on a permutation word problem, "
    "block mask versus mask = ones, then generate",
    description=demo.__doc__.split("\n\n")[0],
  )
  demo.add_arguments(p)
  p.set_defaults(func=demo.run)
  p = sub.add_parser(
    "check",
    help="run the operator forward and backward under jax.jit and "
    "check both against the recurrent reference",
  )
  p.add_argument(
    "--implementation", default=None, choices=list(dispatch.implementations("gated_delta_product"))
  )
  p.set_defaults(func=check)
  from gdp_jax import bench

  p = sub.add_parser(
    "bench",
    help="time the operator forward and forward + backward across "
    "implementations: table (ms, TFLOP/s, GB/s), JSON and PNG",
    description=bench.__doc__.split("\n\n")[0],
  )
  bench.add_arguments(p)
  p.set_defaults(func=bench.run)
  from gdp_jax import train_lm

  p = sub.add_parser(
    "train-lm",
    help="train a byte-level hybrid LM on the Python standard "
    "library: learning curves, tokens/s, MFU (JSON + PNG)",
    description=train_lm.__doc__.split("\n\n")[0],
    epilog="presets, corpus and FLOP count: docs/train_lm.md",
  )
  train_lm.add_arguments(p)
  p.set_defaults(func=train_lm.run)
  args = parser.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
