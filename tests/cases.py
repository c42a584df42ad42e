"""Shared test inputs and dtype-scaled tolerances (one place for every test module).

The operator's random inputs and the named shapes come from gdp_jax/testing.py, which the
benchmarks use too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdp_jax.ops.gated_delta_product import xla
from gdp_jax.ops.validation import normalize_mask
from gdp_jax.testing import random_inputs as make_inputs  # noqa: F401  (re-exported)

# Implementations that take a narrower input domain (dtype, head dim, ...) than the shared tests
# use: "mosaic_gpu" (bfloat16/float16, K = 64 or 128), tested in tests/test_mosaic_gpu_impl.py.
NARROW_IMPLEMENTATIONS = ("mosaic_gpu",)


def general_backends(function):
  """The implementations of `function` ("gated_delta_product" or "gated_delta_product_step")
  that take every input the tests use."""
  from gdp_jax.ops.gated_delta_product.api import REGISTRY
  from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY

  names = {"gated_delta_product": REGISTRY, "gated_delta_product_step": STEP_REGISTRY}
  return tuple(n for n in names[function].names() if n not in NARROW_IMPLEMENTATIONS)


# Relative error allowed, measured as max|x - ref| / max(max|ref|, 1e-6) over the whole array.
# float32 runs with full-precision matmuls and is tight; half types get a few of their ulps.
TOLERANCE = {
  jnp.float32: 2e-5,
  jnp.bfloat16: 3e-2,
  jnp.float16: 6e-3,
}
# Gradients go through one more chunked pass (and a triangular solve): a little looser.
GRAD_TOLERANCE = {
  jnp.float32: 1e-4,
  jnp.bfloat16: 5e-2,
  jnp.float16: 1e-2,
}


def tol(dtype, table=TOLERANCE):
  return table[jnp.dtype(dtype).type]


def rel_err(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  assert x.shape == ref.shape, (x.shape, ref.shape)
  assert np.all(np.isfinite(x)), "non-finite values"
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-6))


def assert_close(x, ref, rtol, what=""):
  err = rel_err(x, ref)
  assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:.3g}"


def stage_inputs(r, mask_kind, chunk, B=2, T=64, H=2, K=64, V=32, dtype=jnp.float32, seed=0):
  inp = make_inputs(seed, B=B, T=T, H=H, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
  mask, _ = normalize_mask(inp["mask"], B, T, H, K)
  g = xla.to_head_major(inp["g"])
  beta = xla.to_head_major(inp["beta"])
  gcum = xla.chunk_local_cumsum(g, chunk)
  return dict(inp, mask=mask, g_hm=g, beta_hm=beta, gcum=gcum, chunk=chunk, r=r)


def cotangents(seed, o_shape, state_shape):
  rng = np.random.default_rng(seed + 1000)
  return (
    jnp.asarray(rng.standard_normal(o_shape), jnp.float32),
    jnp.asarray(rng.standard_normal(state_shape), jnp.float32),
  )


OPERATOR_ARRAYS = ("q", "k", "v", "g", "beta", "mask", "initial_state")


def present_arrays(inputs):
  """(names, avals) of the operator's array inputs that are not None, in signature order."""
  names = [n for n in OPERATOR_ARRAYS if inputs.get(n) is not None]
  return names, [jax.ShapeDtypeStruct(inputs[n].shape, inputs[n].dtype) for n in names]


def grads_program(fn, inputs, seed=0):
  """(grads, args): grads(*args) is {name: gradient of <o, do> + <final, dfinal>} for every array
  input of `fn` (traceable: `loss_and_grads` jits it; tests/one_program.py runs several as one
  program)."""
  names, _ = present_arrays(inputs)
  B, T, _, K = inputs["q"].shape
  H, V = inputs["v"].shape[2:]  # the value heads (grouped value heads: q, k may have fewer)
  do, dfinal = cotangents(seed, (B, T, H, V), (B, H, K, V))

  def loss(*arrays):
    kw = dict(inputs)
    kw.update(zip(names, arrays))
    o, final = fn(**kw)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal)

  grad = jax.grad(loss, argnums=tuple(range(len(names))))
  return (lambda *arrays: dict(zip(names, grad(*arrays)))), [inputs[n] for n in names]


def loss_and_grads(fn, inputs, seed=0):
  """Gradient of <o, do> + <final, dfinal> with respect to every array input of `fn`.

  The gradient runs as one jitted program: run eagerly, every operation of the forward and the
  backward compiles on its own, which on a CPU takes several times longer than the one compile."""
  grads, args = grads_program(fn, inputs, seed)
  return jax.jit(grads)(*args)


def outputs_and_grads(fn, inputs, names=OPERATOR_ARRAYS, seed=0):
  """(fn(**inputs), gradient of <o, do> + <final, dfinal> in every array input of `names`), as
  one jitted program: the outputs are the gradient's primal values, so the forward compiles once
  (inside the gradient) instead of once more on its own. For forms JAX differentiates (the
  reference, "xla", the layers): a custom_vjp's forward under differentiation may be another
  program than its plain call, which is then worth a call of its own."""
  names = [n for n in names if inputs.get(n) is not None]
  o, final = jax.eval_shape(lambda kw: fn(**kw), inputs)
  do, dfinal = cotangents(seed, o.shape, final.shape)

  def loss(*arrays):
    o, final = fn(**{**inputs, **dict(zip(names, arrays))})
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal), (o, final)

  step = jax.jit(jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True))
  grads, outputs = step(*[inputs[n] for n in names])
  return outputs, dict(zip(names, grads))


# ---- independent float64 numpy recurrences (no code of ours) ----------------------------------


def np_gated_delta_rule(q, k, v, g, beta, scale, h0=None):
  """Gated DeltaNet: S = exp(g) S; S += beta k (v - k^T S)^T; o = scale q^T S. [B,T,H,*]."""
  q, k, v, g, beta = (
    np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, g, beta)
  )
  B, T, H, K = q.shape
  V = v.shape[-1]
  S = np.zeros((B, H, K, V)) if h0 is None else np.array(h0, np.float64)
  o = np.zeros((B, T, H, V))
  for t in range(T):
    S = np.exp(g[:, t])[..., None, None] * S
    pred = np.einsum("bhk,bhkv->bhv", k[:, t], S)
    u = beta[:, t][..., None] * (v[:, t] - pred)
    S = S + k[:, t][..., :, None] * u[..., None, :]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
  return o, S


def run_interpreted_subprocess(test_file: str, timeout: int, flag: str = "--interpreted") -> dict:
  """Run `python test_file --interpreted` (or another `flag`) with NPROC=8 and return the JSON on
  its last "RESULT " line: the Mosaic GPU interpreter runs each warpgroup as a thread of XLA's CPU
  pool, which starves on a 2-core machine unless the pool is larger
  (docs/mosaic_gpu.md#testing-without-a-gpu)."""
  import json
  import os
  import pathlib
  import subprocess
  import sys

  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, NPROC="8", PYTHONPATH=str(root))
  run = subprocess.run(
    [sys.executable, str(pathlib.Path(test_file).resolve()), flag],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
  assert run.returncode == 0 and lines, run.stderr[-4000:]
  return json.loads(lines[-1][len("RESULT ") :])
