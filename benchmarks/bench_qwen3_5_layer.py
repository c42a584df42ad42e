"""Time a Qwen3.5-shaped Gated DeltaNet layer, forward + backward, on our operator against the
core as JAX model zoos write it (docs/qwen3_5.md#speed).

  python benchmarks/bench_qwen3_5_layer.py --out $OUT/bench_qwen3_5_layer.json   # H200 shape
  python benchmarks/bench_qwen3_5_layer.py --smoke --out /tmp/smoke.json         # CPU, tiny

Shape (Qwen3.5's linear-attention layers): hidden 2048, 16 key heads, 32 value heads, head dims
128, T = 4096, B = 8, bf16. Two rows, each `ours` vs `zoo`:
  core   the recurrent core alone, value_and_grad of sum(o * w) in q, k, v, g, beta: ours is
         `gdp_jax.gated_delta_product` (implementation None: the Pallas kernels on the GPU);
         zoo is `zoo_chunk_gated_delta_rule` below: transformers' chunked form in jnp, float32,
         the chunk's inverse built row by row in a Python loop, a `lax.scan` over chunks,
         differentiated by JAX.
  layer  the whole layer (`layers.GatedDeltaProduct` as `gdp_jax.qwen3_5` builds it: projections,
         short convolution, gates, gated RMSNorm, output projection; bf16 parameters),
         value_and_grad of sum(y * w) in the parameters, with either core as its operator_fn.
Each time is the median of --reps runs after a compile and a warm-up; the outputs of the two
cores are compared (relative RMS). The JSON (jax version, device, command) is written to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flax import nnx  # noqa: E402

from gdp_jax import gated_delta_product  # noqa: E402
from gdp_jax.layers import GatedDeltaProduct  # noqa: E402

f32 = jnp.float32


def zoo_chunk_gated_delta_rule(q, k, v, g, beta, chunk=64):
  """The gated delta rule as JAX model zoos port transformers' `torch_chunk_gated_delta_rule`:
  q, k [B, T, H, K], v [B, T, HV, V] (value head i reads key head i // (HV / H)), g, beta
  [B, T, HV]; float32 inside, scale K^-0.5; returns o [B, T, HV, V] in v's dtype."""
  out_dtype = v.dtype
  batch, t_len, heads, dim_k = k.shape
  heads_v = v.shape[2]
  q, k = (jnp.repeat(x, heads_v // heads, axis=2) for x in (q, k))
  q, k, v, beta, g = (jnp.swapaxes(x, 1, 2).astype(f32) for x in (q, k, v, beta, g))
  q = q * dim_k**-0.5
  pad = -t_len % chunk
  q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
  beta, g = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (beta, g))
  n = (t_len + pad) // chunk
  v_beta, k_beta = v * beta[..., None], k * beta[..., None]
  q, k, v_beta, k_beta = (x.reshape(x.shape[:2] + (n, chunk, -1)) for x in (q, k, v_beta, k_beta))
  g = jnp.cumsum(g.reshape(g.shape[:2] + (n, chunk)), axis=-1)
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  decay = jnp.exp(jnp.where(lower, g[..., :, None] - g[..., None, :], -jnp.inf))
  attn = jnp.where(
    lower & ~jnp.eye(chunk, dtype=bool), -(k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0
  )
  for i in range(1, chunk):  # (I + A)^-1 by forward substitution, one row at a time
    row, sub = attn[..., i, :i], attn[..., :i, :i]
    attn = attn.at[..., i, :i].set(row + jnp.sum(row[..., None] * sub, axis=-2))
  attn = attn + jnp.eye(chunk, dtype=f32)
  value = attn @ v_beta
  k_cumdecay = attn @ (k_beta * jnp.exp(g)[..., None])
  qk = jnp.where(lower, (q @ jnp.swapaxes(k, -1, -2)) * decay, 0)

  def step(state, xs):
    q_i, k_i, u_i, w_i, g_i, qk_i = xs
    v_new = u_i - w_i @ state
    o = (q_i * jnp.exp(g_i)[..., None]) @ state + qk_i @ v_new
    k_dec = k_i * jnp.exp(g_i[..., -1:] - g_i)[..., None]
    state = state * jnp.exp(g_i[..., -1])[..., None, None] + jnp.swapaxes(k_dec, -1, -2) @ v_new
    return state, o

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, value, k_cumdecay, g, qk))
  state0 = jnp.zeros((batch, heads_v, dim_k, v.shape[-1]), f32)
  _, o = jax.lax.scan(step, state0, xs)  # [n, B, HV, C, V]
  o = jnp.moveaxis(o, 0, 2).reshape(batch, heads_v, n * chunk, -1)[:, :, :t_len]
  return jnp.swapaxes(o, 1, 2).astype(out_dtype)


def zoo_operator(q, k, v, g, beta, mask=None, *, initial_state=None, output_final_state=False):
  """`zoo_chunk_gated_delta_rule` as a layer's operator_fn (r = 1, no state in or out)."""
  del mask, initial_state, output_final_state
  return zoo_chunk_gated_delta_rule(q, k, v, g, beta), None


def ours_core(q, k, v, g, beta):
  return gated_delta_product(q, k, v, g, beta)[0]


def median_ms(fn, args, reps):
  jax.block_until_ready(fn(*args))  # compile
  jax.block_until_ready(fn(*args))  # warm-up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def core_inputs(key, b, t, h, hv, dk, dv, dtype):
  ks = jax.random.split(key, 6)
  norm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = norm(jax.random.normal(ks[0], (b, t, h, dk), f32)).astype(dtype)
  k = norm(jax.random.normal(ks[1], (b, t, h, dk), f32)).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, hv, dv), f32).astype(dtype)
  a_log = jnp.log(jax.random.uniform(ks[3], (hv,), f32, 1.0, 16.0))
  g = -jnp.exp(a_log) * jax.nn.softplus(jax.random.normal(ks[4], (b, t, hv), f32) - 4.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[5], (b, t, hv), f32))
  w = jax.random.normal(jax.random.fold_in(key, 7), (b, t, hv, dv), f32)
  return (q, k, v, g, beta), w


def core_step(core):
  def loss(q, k, v, g, beta, w):
    return jnp.sum(core(q, k, v, g, beta).astype(f32) * w)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def layer_step(layer):
  graphdef, params = nnx.split(layer)

  def loss(params, x, w):
    return jnp.sum(nnx.merge(graphdef, params)(x).astype(f32) * w)

  step = jax.jit(jax.value_and_grad(loss))
  return lambda x, w: step(params, x, w)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench.json"))
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
  args = parser.parse_args()
  if args.smoke:
    b, t, d, h, hv, dk, dv, reps = 1, 128, 64, 2, 4, 16, 16, 2
  else:
    b, t, d, h, hv, dk, dv, reps = 8, 4096, 2048, 16, 32, 128, 128, args.reps
  dtype = jnp.bfloat16
  key = jax.random.key(0)
  result = dict(
    command=" ".join(sys.argv),
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    shape=dict(B=b, T=t, hidden=d, key_heads=h, value_heads=hv, K=dk, V=dv, dtype="bfloat16"),
    reps=reps,
  )
  inputs, w = core_inputs(key, b, t, h, hv, dk, dv, dtype)
  o_ours = jax.jit(ours_core)(*inputs).astype(f32)
  o_zoo = jax.jit(zoo_chunk_gated_delta_rule)(*inputs).astype(f32)
  result["core_output_relative_rms"] = float(
    jnp.sqrt(jnp.mean((o_ours - o_zoo) ** 2) / jnp.mean(o_zoo**2))
  )
  del o_ours, o_zoo
  for name, core in (("ours", ours_core), ("zoo", zoo_chunk_gated_delta_rule)):
    result[f"core_{name}_ms"] = median_ms(core_step(core), (*inputs, w), reps)
    print(name, "core", f"{result[f'core_{name}_ms']:.2f} ms", flush=True)
  del inputs
  x = jax.random.normal(jax.random.fold_in(key, 1), (b, t, d), f32).astype(dtype)
  wy = jax.random.normal(jax.random.fold_in(key, 2), (b, t, d), f32)
  for name, operator_fn in (("ours", None), ("zoo", zoo_operator)):
    layer = GatedDeltaProduct(
      d,
      h,
      dk,
      num_v_heads=hv,
      expand_v=dv / dk,
      num_blocks=1,
      mask_mode="ones",
      key_norm="full",
      norm_eps=1e-6,
      param_dtype=dtype,
      operator_fn=operator_fn,
      rngs=nnx.Rngs(0),
    )
    result[f"layer_{name}_ms"] = median_ms(layer_step(layer), (x, wy), reps)
    print(name, "layer", f"{result[f'layer_{name}_ms']:.2f} ms", flush=True)
  result["core_speedup"] = result["core_zoo_ms"] / result["core_ours_ms"]
  result["layer_speedup"] = result["layer_zoo_ms"] / result["layer_ours_ms"]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
