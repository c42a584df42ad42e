"""`generate`: a batch of prompts of different lengths continued by a `HybridLM`, in two
jitted programs (the prefill and a `fori_loop` of decode steps) or one (prefill by steps), each
compiled once per bucket of shapes (docs/inference.md, docs/performance.md#compile-time).

Prefill runs the whole (right-padded) prompts through the chunked operator and causal attention
(short prompts: through the decode step, in the decode loop's program); the decode loop is one
`jax.jit`-ed `fori_loop` of `HybridLM.step` with the per-sequence lengths and the step count
traced, so prompts of new lengths and other numbers of new tokens reuse the compiled programs
(shapes are rounded up to multiples of `pad_to`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.layers import KVCache
from gdp_jax.models.model import HybridLM
from gdp_jax.models.paged import to_paged


def _round_up(n, m):
  return max(m, -(-n // m) * m)


def _pick(logits, key, temperature):
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


# XLA options of generate's two programs (docs/performance.md#compile-time). XLA's GPU GEMM
# autotuner compiles and times many configurations of every distinct matmul of a program; the
# decode loop's matmuls are [B, D] x [D, *] for a handful of sequences B (latency bound,
# microseconds whichever configuration runs), so the loop is compiled without it. The prefill
# keeps XLA's default: its matmuls grow with the prompts. The options are part of the persistent
# cache's key.
PREFILL_COMPILER_OPTIONS: dict[str, Any] = {}
DECODE_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_autotune_level": 0}
# prefill="auto": prompts padded to at most this many tokens are read by the decode step in the
# decode loop (one program, no chunked kernels to compile: seconds less on a first call, at most
# this many more sequential steps per call); longer ones by the chunked operator
# (docs/performance.md#compile-time).
STEP_PREFILL_TOKENS = 64
PREFILL_MODES = ("auto", "chunked", "steps")


def _prefill_program(graphdef, state, tokens, lengths, key, cache_size, temperature, page_size):
  """The first new token [B], the cache after the prompts, and the decode loop's key (the key is
  split here: no eager random op to compile on a first call)."""
  key, decode_key = jax.random.split(key)
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(tokens, lengths, cache_size)
  if page_size is not None:
    cache = tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return _pick(last, key, temperature), cache, decode_key


def _decode_program(graphdef, state, first, cache, key, steps, capacity, temperature):
  """`steps` (traced) decode steps after the prefill's token `first` [B]: int32 [B, capacity]
  whose first steps + 1 columns are the tokens. The step count is traced (a `fori_loop`: the
  step is compiled once, not unrolled) and the buffer's size a multiple of `pad_to`, so every
  max_new_tokens of one bucket shares this compilation; step i samples with `fold_in(key, i)`."""
  model = nnx.merge(graphdef, state)
  out = jnp.zeros((first.shape[0], capacity), jnp.int32).at[:, 0].set(first)

  def body(i, carry):
    token, cache, out = carry
    logits, cache = model.step(token, cache)
    nxt = _pick(logits, jax.random.fold_in(key, i), temperature)
    return nxt, cache, jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i + 1, axis=1)

  _, _, out = jax.lax.fori_loop(0, steps, body, (first, cache, out))
  return out


def _prompt_decode_program(
  graphdef, state, tokens, lengths, key, new_tokens, capacity, cache_size, temperature, page_size
):
  """`generate` with prefill="steps": the prompts read by the decode step itself, in the loop
  that then generates (one program, no chunked kernels: docs/performance.md#compile-time). Every
  sequence advances one token per iteration: sequence b is fed its prompt while i < lengths[b],
  then its own samples; the token sampled at iteration i is its new token j = i - lengths[b] + 1.
  max(lengths) + new_tokens - 1 iterations (traced); a short prompt's sequence generates a few
  tokens past `new_tokens`, unused (the cache holds t_pad + capacity positions). Returns int32
  [B, capacity]; step j of sequence b samples with `fold_in(fold_in(key, b), j)`."""
  model = nnx.merge(graphdef, state)
  batch, width = tokens.shape
  cache = model.init_cache(batch, cache_size)
  if page_size is not None:
    cache = tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)
  rows = jnp.arange(batch)

  def pick(logits, j):
    if temperature == 0.0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda b, jb: jax.random.fold_in(jax.random.fold_in(key, b), jb))(rows, j)
    draw = jax.vmap(lambda k, lg: jax.random.categorical(k, lg / temperature))
    return draw(keys, logits).astype(jnp.int32)

  def body(i, carry):
    prev, cache, out = carry
    token = jnp.where(i < lengths, tokens[:, jnp.minimum(i, width - 1)], prev)
    logits, cache = model.step(token, cache)
    j = i - lengths + 1
    nxt = pick(logits, j)
    col = jnp.clip(j, 0, capacity - 1)
    keep = (j >= 0) & (j < capacity)
    out = out.at[rows, col].set(jnp.where(keep, nxt, out[rows, col]))
    return nxt, cache, out

  out = jnp.zeros((batch, capacity), jnp.int32)
  first = jnp.zeros((batch,), jnp.int32)
  steps = jnp.max(lengths) + new_tokens - 1
  _, _, out = jax.lax.fori_loop(0, steps, body, (first, cache, out))
  return out


@functools.cache
def _jitted_prefill(options: tuple) -> Any:
  return jax.jit(
    _prefill_program,
    static_argnames=("graphdef", "cache_size", "temperature", "page_size"),
    compiler_options=dict(options) or None,
  )


@functools.cache
def _jitted_decode(options: tuple) -> Any:
  return jax.jit(
    _decode_program,
    static_argnames=("graphdef", "capacity", "temperature"),
    compiler_options=dict(options) or None,
  )


@functools.cache
def _jitted_prompt_decode(options: tuple) -> Any:
  return jax.jit(
    _prompt_decode_program,
    static_argnames=("graphdef", "capacity", "cache_size", "temperature", "page_size"),
    compiler_options=dict(options) or None,
  )


def generate_programs(prefill_options: tuple = (), decode_options: tuple = ()) -> tuple[Any, Any]:
  """The jitted prefill and decode loop of `generate`, compiled with the XLA options given as
  sorted (name, value) pairs: one jitted function (hence one trace cache) per program and set of
  options."""
  return _jitted_prefill(prefill_options), _jitted_decode(decode_options)


def _options_key(options: dict) -> tuple:
  return tuple(sorted(options.items()))


# The programs `generate` runs with the default options.
_prefill, _decode = generate_programs(
  _options_key(PREFILL_COMPILER_OPTIONS), _options_key(DECODE_COMPILER_OPTIONS)
)


class GenerateCall(NamedTuple):
  """`generate`'s programs and their arguments (`generate_call`). Chunked prefill:
  prefill(**prefill_args) -> (first, cache, key), then decode(graphdef, state, first, cache,
  key, **decode_args). Prefill by steps: prefill is None and decode(**decode_args) is the one
  program."""

  prefill: Any
  decode: Any
  prefill_args: dict
  decode_args: dict
  max_new_tokens: int

  def run(self) -> jax.Array:
    if self.prefill is None:
      return self.decode(**self.decode_args)[:, : self.max_new_tokens]
    first, cache, key = self.prefill(**self.prefill_args)
    graphdef, state = self.prefill_args["graphdef"], self.prefill_args["state"]
    out = self.decode(graphdef, state, first, cache, key, **self.decode_args)
    return out[:, : self.max_new_tokens]


def generate(
  model: HybridLM,
  prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
  max_new_tokens: int,
  *,
  lengths: jax.Array | np.ndarray | None = None,
  temperature: float = 0.0,
  rng: jax.Array | None = None,
  pad_to: int = 64,
  page_size: int | None = None,
  compiler_options: tuple[dict | None, dict | None] | None = None,
  prefill: str = "auto",
) -> jax.Array:
  """Continue a batch of prompts of different lengths.

  Args:
    model: a `HybridLM`.
    prompts: a list of token-id sequences (lengths may differ, each >= 1), or an int array
      [B, T] of right-padded prompts together with `lengths` [B].
    max_new_tokens: tokens to generate per prompt (>= 1).
    temperature: 0 (default) for greedy decoding, else sampling from softmax(logits / t).
    rng: a `jax.random` key for sampling (default key 0).
    pad_to: prompts and the KV cache are padded to a multiple of this, so calls with other
      prompt lengths reuse the compiled prefill and decode loop.
    page_size: None (default) keeps each attention layer's cache dense ([B, S, Hkv, Dh],
      `gqa_decode`); a power of two >= 16 keeps it in pages of that many positions
      (`PagedKVCache`, decoded by `paged_gqa_decode`; the cache size is rounded up to a multiple
      of it). The tokens are the same either way.
    compiler_options: (prefill, decode) XLA options of the two programs, None for either the
      default (`PREFILL_COMPILER_OPTIONS`, `DECODE_COMPILER_OPTIONS`: the decode loop without
      XLA's GEMM autotuner, docs/performance.md#compile-time); e.g. ({}, {}) compiles both with
      XLA's defaults. With prefill="steps" the decode options compile the one program.
    prefill: "chunked" reads the prompts with the chunked operator and causal attention in one
      call (a program of its own), "steps" with the decode step inside the decode loop (one
      program: fewer kernels to compile, max(lengths) more sequential steps), "auto" (default)
      "steps" when the prompts padded to `pad_to` are at most `STEP_PREFILL_TOKENS` (64) tokens.
      The tokens are the same either way (greedy, up to floating-point ties; sampling draws
      other keys).

  Returns:
    int32 [B, max_new_tokens]: the generated tokens of each prompt (all of them: there is no
    end-of-sequence stop).

  The prompt is prefilled (`prefill`), then a `jax.jit`-ed loop of decode steps runs with the
  lengths and the step count traced: each program is compiled once per bucket of prompt length
  and of max_new_tokens (multiples of `pad_to`).
  """
  return generate_call(
    model,
    prompts,
    max_new_tokens,
    lengths=lengths,
    temperature=temperature,
    rng=rng,
    pad_to=pad_to,
    page_size=page_size,
    compiler_options=compiler_options,
    prefill=prefill,
  ).run()


def generate_call(
  model: HybridLM,
  prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
  max_new_tokens: int,
  *,
  lengths: jax.Array | np.ndarray | None = None,
  temperature: float = 0.0,
  rng: jax.Array | None = None,
  pad_to: int = 64,
  page_size: int | None = None,
  compiler_options: tuple[dict | None, dict | None] | None = None,
  prefill: str = "auto",
) -> GenerateCall:
  """`generate`'s arguments checked and padded into its two jitted programs and their
  arguments, not run (`GenerateCall.run()` runs them; benchmarks/compile_profile.py times each
  program's trace, lowering and compile)."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature!r}")
  if lengths is None:
    if isinstance(prompts, (jax.Array, np.ndarray)):
      prompts = np.asarray(prompts)
      if prompts.ndim != 2:
        raise ValueError(f"prompts as an array must be [B, T], got shape {prompts.shape}")
      lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)
      tokens = prompts
    else:
      seqs = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
      if not seqs or min(len(s) for s in seqs) < 1:
        raise ValueError("prompts must be a non-empty list of non-empty token sequences")
      lengths = np.array([len(s) for s in seqs], np.int32)
      tokens = np.zeros((len(seqs), int(lengths.max())), np.int32)
      for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
  else:
    tokens, lengths = np.asarray(prompts), np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
      raise ValueError(
        f"prompts [B, T] and lengths [B] expected, got shapes {tokens.shape} and {lengths.shape}"
      )
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
      raise ValueError(f"lengths must lie in [1, T = {tokens.shape[1]}], got {lengths}")
  vocab = model.config.vocab_size
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
    raise ValueError(f"prompt tokens must lie in [0, vocab_size = {vocab})")
  if page_size is not None and (
    isinstance(page_size, bool)
    or not isinstance(page_size, int)
    or page_size < 16
    or page_size & (page_size - 1)
  ):
    raise ValueError(f"page_size must be None or a power of two >= 16, got {page_size!r}")
  # Every shape is a multiple of pad_to (docs/performance.md#compile-time): prompt lengths and
  # max_new_tokens within one bucket reuse the compiled prefill and decode loop.
  t_pad = _round_up(tokens.shape[1], pad_to)
  tokens = np.pad(tokens, ((0, 0), (0, t_pad - tokens.shape[1])))
  capacity = _round_up(max_new_tokens, pad_to)
  cache_size = t_pad + capacity
  if page_size is not None:
    cache_size = _round_up(cache_size, page_size)
  key = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  if compiler_options is not None and (
    not isinstance(compiler_options, (tuple, list))
    or len(compiler_options) != 2
    or not all(o is None or isinstance(o, dict) for o in compiler_options)
  ):
    raise TypeError(
      f"compiler_options must be None or a pair (prefill, decode) of dicts of XLA options "
      f"(or None for either's default), got {compiler_options!r}"
    )
  if prefill not in PREFILL_MODES:
    raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
  if prefill == "auto":
    prefill = "steps" if t_pad <= STEP_PREFILL_TOKENS else "chunked"
  prefill_opts, decode_opts = compiler_options or (None, None)
  prefill_opts = PREFILL_COMPILER_OPTIONS if prefill_opts is None else prefill_opts
  decode_opts = DECODE_COMPILER_OPTIONS if decode_opts is None else decode_opts
  # NumPy operands go straight to the jitted functions (no eager op to compile first)
  prompt_args = dict(
    graphdef=graphdef,
    state=state,
    tokens=np.asarray(tokens, np.int32),
    lengths=np.asarray(lengths, np.int32),
    key=key,
    cache_size=cache_size,
    temperature=float(temperature),
    page_size=page_size,
  )
  if prefill == "steps":
    program = _jitted_prompt_decode(_options_key(decode_opts))
    args = dict(prompt_args, new_tokens=np.int32(max_new_tokens), capacity=capacity)
    return GenerateCall(None, program, {}, args, max_new_tokens)
  prefill_program, decode = generate_programs(_options_key(prefill_opts), _options_key(decode_opts))
  decode_args = dict(
    steps=np.int32(max_new_tokens - 1), capacity=capacity, temperature=float(temperature)
  )
  return GenerateCall(prefill_program, decode, prompt_args, decode_args, max_new_tokens)
