"""Where a train-lm training step's time goes: the step against the sum of its parts.

  python benchmarks/profile_train_step.py --out step.json [--model gdp-r2] [--preset h200]
  python benchmarks/profile_train_step.py --out smoke.json --smoke   # tiny preset, few reps

For one preset and model kind of `python -m examples.byte_lm` (bf16 compute, everything under
`jax.jit`, medians of repeated timed loops, `benchmarks.bench.time_jax`):

1. `step`: the full training step, the jitted step train-lm itself runs (`compiled_steps`), on
   one real batch, parameters and optimizer state carried from step to step (donated on a GPU);
   also `forward_backward` (loss and gradients, no optimizer) and `forward` (the loss alone),
   timed last, not with --smoke;
2. `matmuls`: every dense projection and the vocabulary head of one step alone, forward and
   backward (y = x W, dx = dy W^T, dW = x^T dy for each 2-D `kernel` of the parameters, x
   [B*T, in], bf16 operands), as one jitted function (the embedding is a gather, not counted);
3. `operator`: the token mixer's operator alone, forward + backward, at the layer's shapes
   (B, T, heads, head dims, r, chunk size of the preset), times the number of such layers;
   `attention`: the attention kernel the model uses (flash on a GPU), likewise;
4. `ratio` = step / (matmuls + operator + attention): the layer's speed goal is <= 1.25.

The JSON (written after every part) holds the date, jax version, GPU, command, preset, model
kind and each part's median ms (or its error).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from benchmarks.bench import time_jax  # noqa: E402
from examples.byte_lm import train_lm as tl  # noqa: E402
from gdp_jax import householder_delta_product, layers  # noqa: E402
from gdp_jax.sharding import sharded_gated_delta_product  # noqa: E402
from gdp_jax.testing import random_inputs  # noqa: E402


def command(argv=None):
  """The command line (`argv`: this script's arguments, default sys.argv's) with paths inside
  the repository made relative to it and other absolute paths reduced to their file name."""
  out = ["python"]
  argv = sys.argv if argv is None else [os.path.abspath(__file__), *argv]
  for arg in argv:
    if os.path.isabs(arg):
      rel = os.path.relpath(arg, ROOT)
      arg = rel if not rel.startswith("..") else os.path.basename(arg)
    out.append(arg)
  return " ".join(out)


def setup(preset, model, seed=0):
  """(cfg, mc, graphdef, params, batch) of a train-lm run: the model as train_lm builds it and
  the batch of its first step."""
  from flax import nnx

  from gdp_jax.models import HybridLM

  cfg = tl.preset_config(preset, model=model, progress=False, seed=seed)
  cfg.validate()
  mc = tl.model_config(cfg)
  graphdef, params = nnx.split(HybridLM(mc, rngs=nnx.Rngs(cfg.seed)))
  corpus = tl.load_corpus(cfg.corpus_dir, cfg.val_percent)
  batch = tuple(
    jnp.asarray(a) for a in tl.train_batch(corpus.train, 0, cfg.seed, cfg.batch_size, cfg.seq_len)
  )
  return cfg, mc, graphdef, params, batch


# ----------------------------------------------------------------------------------------------
# 1. The step
# ----------------------------------------------------------------------------------------------


def step_time(cfg, graphdef, params, batch, reps, inner):
  """Median ms of train-lm's jitted training step (parameters and optimizer state carried from
  step to step, donated on a GPU as in train_lm)."""
  donate = jax.default_backend() != "cpu"
  train_step, _ = tl.compiled_steps(donate)
  hp = tl.Hyper(
    cfg.lr,
    cfg.min_lr_ratio,
    min(cfg.warmup_steps, cfg.steps // 2),
    cfg.steps,
    cfg.weight_decay,
    cfg.b1,
    cfg.b2,
    cfg.clip_norm,
  )
  opt_state = tl.optimizer(hp).init(params)
  dev = jax.devices()[0]
  state = list(jax.device_put((jax.tree.map(jnp.copy, params), opt_state), dev))
  schedule = jnp.asarray(hp.schedule_array())

  def one_step():
    p, o, loss, _ = train_step(graphdef, hp.static(), schedule, state[0], state[1], *batch)
    state[0], state[1] = p, o
    return loss

  ms = time_jax(one_step, (), reps, inner)[0]
  state.clear()  # free the copies before the next parts
  return ms


def extra_times(graphdef, params, batch, reps, inner, record):
  """record(name, median ms) of loss + gradients without the optimizer ("forward_backward")
  and of the loss alone ("forward", train-lm's jitted evaluation)."""

  def loss_fn(p, inputs, targets, seg):
    total, count = tl._loss_sums(graphdef, p, inputs, targets, seg)
    return total / count

  grad = jax.jit(jax.value_and_grad(loss_fn))
  record("forward_backward", time_jax(grad, (params, *batch), reps, inner)[0])
  eval_sums = tl.compiled_steps(jax.default_backend() != "cpu")[1]
  fwd = lambda p, *b: eval_sums(graphdef, p, *b)
  record("forward", time_jax(fwd, (params, *batch), reps, inner)[0])


# ----------------------------------------------------------------------------------------------
# 2. The matmuls
# ----------------------------------------------------------------------------------------------


def matmul_shapes(params, tokens):
  """[(parameter path, tokens, in, out)] of every 2-D `kernel` (a dense projection or the
  vocabulary head; the embedding, a gather, is not one)."""
  shapes = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    if leaf.ndim == 2 and "['kernel']" in name:
      shapes.append((name.replace(".value", ""), tokens, int(leaf.shape[0]), int(leaf.shape[1])))
  return shapes


def matmuls_fn(shapes, dtype, seed=0):
  """(jitted fn, args): y = x W, dx = dy W^T, dW = x^T dy for each shape, in one function."""
  keys = jax.random.split(jax.random.key(seed), 3 * len(shapes))
  xs = [jax.random.normal(keys[3 * i], (n, a), dtype) for i, (_, n, a, _) in enumerate(shapes)]
  ws = [
    jax.random.normal(keys[3 * i + 1], (a, b), dtype) * a**-0.5
    for i, (_, _, a, b) in enumerate(shapes)
  ]
  dys = [jax.random.normal(keys[3 * i + 2], (n, b), dtype) for i, (_, n, _, b) in enumerate(shapes)]

  def fn(xs, ws, dys):
    ys, vjp = jax.vjp(lambda xs, ws: [x @ w for x, w in zip(xs, ws)], xs, ws)
    return ys, vjp(dys)  # every product is an output: none is dropped

  return jax.jit(fn), (xs, ws, dys)


# ----------------------------------------------------------------------------------------------
# 3. The operator and attention
# ----------------------------------------------------------------------------------------------


def _grad_fn(fwd, args, seed=0):
  """(jitted fn, args): the gradients of sum(fwd(*args) * do) with respect to every float
  argument (forward + backward), do a fixed random cotangent."""
  out = jax.eval_shape(fwd, *args)
  do = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32)
  idx = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
  grad = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * do), argnums=idx)
  return jax.jit(grad), args


def operator_case(cfg, mc, dtype):
  """(description, jitted fwd + bwd, args) of one gated delta product layer's operator call, as
  `GatedDeltaProduct.__call__` makes it, or None without such layers."""
  count = sum(kind in "DH" for kind in mc.layer_pattern)
  if not count:
    return None
  B, T, H, K = cfg.batch_size, cfg.seq_len, mc.num_heads, mc.head_dim
  V = int(K * mc.expand_v)
  if mc.mask_mode == "householder":
    n = mc.num_householder
    x = random_inputs(0, B=B, T=T * n, H=H, K=K, V=V, r=1, mask_kind=None, dtype=dtype)
    q, g = x["q"][:, :T], x["g"][:, :T]
    fwd = lambda q, k, v, g, beta: householder_delta_product(
      q,
      k,
      v,
      g,
      beta,
      num_householder=n,
      chunk_size=mc.chunk_size,
      implementation=mc.implementation,
    )[0]
    args = (q, x["k"], x["v"], g, x["beta"])
    desc = dict(kind="householder", B=B, T=T, H=H, K=K, V=V, num_householder=n)
  else:
    r = 1 if mc.mask_mode == "ones" else mc.num_blocks
    kind = {"ones": None, "static": "head", "token": "token"}[mc.mask_mode]
    x = random_inputs(0, B=B, T=T, H=H, K=K, V=V, r=r, mask_kind=kind, dtype=dtype)

    def fwd(q, k, v, g, beta, *mask):
      return sharded_gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        mask[0] if mask else None,
        chunk_size=mc.chunk_size,
        implementation=mc.implementation,
        sharding=None,
      )[0]

    args = tuple(x[n] for n in ("q", "k", "v", "g", "beta")) + (
      () if x["mask"] is None else (x["mask"],)
    )
    desc = dict(kind=mc.mask_mode, B=B, T=T, H=H, K=K, V=V, r=r)
  desc.update(chunk_size=mc.chunk_size, implementation=mc.implementation, layers=count)
  return (desc, *_grad_fn(fwd, args))


def attention_case(cfg, mc, dtype, segment_ids):
  """(description, jitted fwd + bwd, args) of one attention layer's kernel (the whole-sequence
  attention `GroupedQueryAttention.__call__` runs, with the batch's segment ids), or None."""
  count = mc.layer_pattern.count("A")
  if not count:
    return None
  B, T, hq, hkv = cfg.batch_size, cfg.seq_len, mc.attn_num_heads, mc.attn_num_kv_heads
  dh = mc.attn_head_dim or mc.hidden_size // hq
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (B, T, hq, dh), dtype)
  k = jax.random.normal(keys[1], (B, T, hkv, dh), dtype)
  v = jax.random.normal(keys[2], (B, T, hkv, dh), dtype)
  impl = mc.attn_impl
  if impl == "flash":
    fwd = lambda q, k, v, seg: layers._flash_attention(q, k, v, seg)
  else:

    def fwd(q, k, v, seg):
      mask = (seg[:, :, None] == seg[:, None, :])[:, None]
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

  desc = dict(impl=impl, B=B, T=T, Hq=hq, Hkv=hkv, Dh=dh, layers=count)
  return (desc, *_grad_fn(fwd, (q, k, v, segment_ids)))


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON file to write")
  p.add_argument("--model", default="gdp-r2", choices=list(tl.MODELS), help="train-lm --model")
  p.add_argument("--preset", default="h200", choices=list(tl.PRESETS), help="train-lm --preset")
  p.add_argument("--reps", type=int, default=7, help="timed loops per part (median)")
  p.add_argument("--inner", type=int, default=3, help="calls per timed loop")
  p.add_argument(
    "--smoke",
    action="store_true",
    help="a quick check of the script: the tiny preset, 2 loops of 1 call, no forward_backward "
    "and forward parts",
  )
  args = p.parse_args(argv)
  if args.smoke:
    args.preset, args.reps, args.inner = "tiny", 2, 1
  if args.reps < 1 or args.inner < 1:
    raise ValueError(f"--reps and --inner must be >= 1, got {args.reps}, {args.inner}")
  dtype = jnp.bfloat16
  res: dict = dict(
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    jax=jax.__version__,
    backend=jax.default_backend(),
    device=getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform),
    command=command(argv),
    preset=args.preset,
    model=args.model,
    dtype="bf16",
    reps=args.reps,
    inner=args.inner,
    parts={},
    errors={},
  )

  def dump():
    ms = res["parts"]
    need = ("step", "matmuls", "operator_total", "attention_total")
    if all(k in ms for k in need):
      res["sum_ms"] = ms["matmuls"] + ms["operator_total"] + ms["attention_total"]
      res["ratio"] = ms["step"] / res["sum_ms"]
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)

  def part(name, fn):
    try:
      fn()
    except Exception as e:  # a part that fails is recorded; the others still run
      res["errors"][name] = (
        f"{type(e).__name__}: {e}"[:3000] + "\n" + traceback.format_exc()[-3000:]
      )
      print(f"{name}: ERROR {type(e).__name__}: {str(e)[:1000]}", flush=True)
    dump()

  cfg, mc, graphdef, params, batch = setup(args.preset, args.model)
  tokens = cfg.batch_size * cfg.seq_len
  res.update(
    layer_pattern=mc.layer_pattern,
    tokens_per_step=tokens,
    params=tl.count_params(params),
    implementation=mc.implementation,
    attn_impl=mc.attn_impl,
  )
  dump()

  def record(name, ms):
    res["parts"][name] = ms
    print(f"{name:18s} {ms:9.3f} ms", flush=True)
    dump()

  def do_step():
    record("step", step_time(cfg, graphdef, params, batch, args.reps, args.inner))

  def do_matmuls():
    shapes = matmul_shapes(params, tokens)
    fn, fargs = matmuls_fn(shapes, dtype)
    ms = time_jax(fn, fargs, args.reps, args.inner)[0]
    flops = sum(6.0 * n * a * b for _, n, a, b in shapes)
    res["parts"]["matmuls"] = ms
    res["matmuls"] = dict(
      count=len(shapes),
      flops=flops,
      tflops_per_s=flops / ms * 1e-9,
      shapes=[dict(param=s, tokens=n, fan_in=a, fan_out=b) for s, n, a, b in shapes],
    )
    print(
      f"{'matmuls':18s} {ms:9.3f} ms ({len(shapes)} kernels, {flops / ms * 1e-9:.0f} TFLOP/s)",
      flush=True,
    )
    del fargs

  def do_mixer(name, case):
    if case is None:
      res["parts"][f"{name}_total"] = 0.0
      return
    desc, fn, fargs = case
    ms = time_jax(fn, fargs, args.reps, args.inner)[0]
    res[name] = desc
    res["parts"][f"{name}_per_layer"] = ms
    res["parts"][f"{name}_total"] = ms * desc["layers"]
    print(f"{name:18s} {ms:9.3f} ms per layer x {desc['layers']}", flush=True)

  part("step", do_step)
  part("matmuls", do_matmuls)
  part("operator", lambda: do_mixer("operator", operator_case(cfg, mc, dtype)))
  part("attention", lambda: do_mixer("attention", attention_case(cfg, mc, dtype, batch[2])))
  if not args.smoke:
    part("extras", lambda: extra_times(graphdef, params, batch, args.reps, args.inner, record))
  if "ratio" in res:
    print(f"step / (matmuls + operator + attention) = {res['ratio']:.3f} (goal <= 1.25)")
  return res


if __name__ == "__main__":
  main()
