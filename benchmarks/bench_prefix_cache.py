"""Time `generate` with a `PrefixCache` against without, and the speculative example's rounds
(docs/inference.md#prefix-caching, docs/inference.md#rolling-back-a-model).

  python benchmarks/bench_prefix_cache.py --out $OUT/prefix_cache.json        # GPU
  python benchmarks/bench_prefix_cache.py --smoke --out /tmp/prefix.json       # any machine

prefix: a float32 `HybridLM` (vocab 256, width 512, "DDA"), prompts of a shared `--prefix`
(1024) tokens and `--suffix` (64) own tokens, `--new` (16) new tokens each, `--block` (256)
tokens per cache block read `--per-call` (default 64) tokens per call. Each prompt runs once
to compile; then, per fresh prompt, generate's wall time without the cache and with it (the
prefix already cached): median seconds, the prompt tokens the cached call computed and whether
the tokens agree.
speculative: `examples/speculative.py`'s run (its calls and whether it equals greedy decoding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import numpy as np
from flax import nnx

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from examples import speculative  # noqa: E402
from gdp_jax.models import HybridConfig, HybridLM, PrefixCache, generate  # noqa: E402


def prefix_runs(args):
  width = 64 if args.smoke else 512
  config = HybridConfig(
    vocab_size=256, hidden_size=width, layer_pattern="DDA", chunk_size=args.chunk
  )
  model = HybridLM(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  shared = rng.integers(0, 256, args.prefix)
  prompt = lambda: np.concatenate([shared, rng.integers(0, 256, args.suffix)])
  cache = PrefixCache(block_tokens=args.block, tokens_per_call=args.per_call)

  def timed(p, **kw):
    t0 = time.perf_counter()
    out = np.asarray(generate(model, [p], args.new, **kw))
    return out, time.perf_counter() - t0

  for _ in range(2):  # compile both paths (the second cached call reads the cache)
    p = prompt()
    timed(p)
    timed(p, prefix_cache=cache)
  plain_s, cached_s, equal, computed = [], [], True, []
  for _ in range(args.reps):
    p = prompt()
    before = cache.computed_tokens
    out_c, t_c = timed(p, prefix_cache=cache)
    out_p, t_p = timed(p)
    plain_s.append(t_p)
    cached_s.append(t_c)
    computed.append(cache.computed_tokens - before)
    equal &= bool(np.array_equal(out_c, out_p))
  return dict(
    prompt_tokens=args.prefix + args.suffix,
    block_tokens=args.block,
    tokens_per_call=cache.tokens_per_call,
    new_tokens=args.new,
    plain_s=statistics.median(plain_s),
    cached_s=statistics.median(cached_s),
    computed_tokens_per_cached_call=computed,
    equal_tokens=equal,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prefix", type=int, default=1024)
  parser.add_argument("--suffix", type=int, default=64)
  parser.add_argument("--new", type=int, default=16)
  parser.add_argument("--block", type=int, default=256)
  parser.add_argument("--chunk", type=int, default=64)
  parser.add_argument("--per-call", type=int, default=None, help="PrefixCache tokens_per_call")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--smoke", action="store_true", help="tiny sizes (any machine)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.smoke:
    args.prefix, args.suffix, args.new, args.block, args.chunk, args.reps = 32, 8, 4, 16, 16, 2
  result = dict(
    date=datetime.date.today().isoformat(),
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    command="python benchmarks/bench_prefix_cache.py " + " ".join(argv or sys.argv[1:]),
    prefix=prefix_runs(args),
    speculative=speculative.main(["--new-tokens", "8" if args.smoke else "64"]),
  )
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
