"""`gqa_decode`: the problem statement's examples, random cases against a float64 numpy
computation, stale slots, no recompilation across lengths, edge cases and argument checks.
Both implementations everywhere ("pallas" runs in interpret mode on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gqa_decode
from gdp_jax.ops import registry
from gdp_jax.ops.gqa_decode.api import REGISTRY
from pallas_kernels.triton.inference import decode_attention
from tests.cases import assert_close
from tests.triton_lowering import lower_for_h200

IMPLS = ["xla", "pallas"]
# bfloat16 caches hold exact values; only the float32 arithmetic (and, in the kernel, the
# two-part bf16 split of the query and the weights) errs.
CACHE_TOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-4}


def np_gqa(query, key_cache, value_cache, lengths, scale=None):
  """Float64 numpy, only the valid slots ever touched."""
  q = np.asarray(jnp.asarray(query, jnp.float32), np.float64)
  kc = np.asarray(jnp.asarray(key_cache, jnp.float32), np.float64)
  vc = np.asarray(jnp.asarray(value_cache, jnp.float32), np.float64)
  B, Hq, D = q.shape
  S, Hkv = kc.shape[1], kc.shape[2]
  G = Hq // Hkv
  scale = D**-0.5 if scale is None else scale
  out = np.zeros((B, Hq, D))
  for b in range(B):
    n = int(min(max(int(lengths[b]), 0), S))
    if n == 0:
      continue
    for h in range(Hq):
      kk = kc[b, :n, h // G]
      vv = vc[b, :n, h // G]
      s = scale * (kk @ q[b, h])
      w = np.exp(s - s.max())
      out[b, h] = (w / w.sum()) @ vv
  return out


# ---- the problem statement's examples --------------------------------------------------------

EXAMPLES = [
  dict(
    query=[[[1, 0], [0, 1]]],
    key_cache=[[[[1, 0]], [[0, 1]], [[5, 5]]]],
    value_cache=[[[[1, 2]], [[3, 4]], [[50, 50]]]],
    lengths=[2],
    out=[[[1.660477, 2.660477], [2.339523, 3.339523]]],
  ),
  dict(
    query=[[[1, 0], [0, 1], [1, 1], [-1, 0]], [[0.5, 0.5], [1, -1], [0, 2], [2, 0]]],
    key_cache=[
      [[[1, 0], [0, 1]], [[0, 1], [1, 0]], [[1, 1], [-1, 1]]],
      [[[1, 0], [0, 1]], [[9, 9], [9, 9]], [[9, 9], [9, 9]]],
    ],
    value_cache=[
      [[[1, 0], [0, 1]], [[0, 1], [1, 0]], [[2, 2], [-2, 2]]],
      [[[1, 2], [3, 4]], [[90, 90], [90, 90]], [[90, 90], [90, 90]]],
    ],
    lengths=[3, 1],
    out=[
      [[1.203336, 1.0], [1.0, 1.203336], [0.00556, 0.796664], [-1.011921, 1.435946]],
      [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [3.0, 4.0]],
    ],
  ),
  dict(
    query=[[[1, 0, 1, 0], [0, 2, 0, -1]]],
    key_cache=[
      [
        [[1, 1, 0, 0], [0, 1, 0, 1]],
        [[0, 0, 1, 1], [1, 0, 1, 0]],
        [[1, 0, 0, 1], [0, 0, 2, 0]],
        [[0, 1, 1, 0], [1, 1, 1, 1]],
      ]
    ],
    value_cache=[
      [
        [[1, 0, 0, 0], [0, 1, 0, 0]],
        [[0, 1, 0, 0], [0, 0, 1, 0]],
        [[0, 0, 1, 0], [0, 0, 0, 1]],
        [[0, 0, 0, 1], [1, 0, 0, 0]],
      ]
    ],
    lengths=[4],
    out=[[[0.25, 0.25, 0.25, 0.25], [0.31123, 0.31123, 0.18877, 0.18877]]],
  ),
]


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_problem_examples(index, cache_dtype, implementation):
  ex = EXAMPLES[index]
  query = jnp.asarray(ex["query"], jnp.float32)
  kc = jnp.asarray(ex["key_cache"], cache_dtype)  # small integers: exact in bfloat16
  vc = jnp.asarray(ex["value_cache"], cache_dtype)
  lengths = jnp.asarray(ex["lengths"], jnp.int32)
  f = jax.jit(lambda q, k, v, n: gqa_decode(q, k, v, n, implementation=implementation))
  out = f(query, kc, vc, lengths)
  assert out.dtype == jnp.float32 and out.shape == query.shape
  atol = 2e-6 if cache_dtype == jnp.float32 else 2e-5
  # The statement prints 6 decimals (5 for some entries): allow that rounding.
  np.testing.assert_allclose(np.asarray(out), np.asarray(ex["out"]), rtol=0, atol=5e-6 + atol)


# ---- random cases against float64 numpy ------------------------------------------------------


def make_case(seed, B=3, S=40, Hkv=2, G=4, D=32, dtype=jnp.float32, lengths=None, stale=1e30):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, Hkv * G, D)).astype(np.float32) * 2.0
  kc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
  vc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
  if lengths is None:
    lengths = np.array([S, 1] + list(rng.integers(1, S + 1, size=B - 2)), np.int32)[:B]
  lengths = np.asarray(lengths, np.int32)
  kc = np.array(jnp.asarray(kc, dtype).astype(jnp.float32))  # exact in the cache dtype
  vc = np.array(jnp.asarray(vc, dtype).astype(jnp.float32))
  ref = np_gqa(q, kc, vc, lengths)  # before the stale fill
  if stale is not None:
    for b in range(B):
      n = max(int(lengths[b]), 0)
      kc[b, n:] = stale
      vc[b, n:] = -stale if np.isfinite(stale) else stale
  return (jnp.asarray(q), jnp.asarray(kc, dtype), jnp.asarray(vc, dtype), jnp.asarray(lengths), ref)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_random_against_numpy(G, cache_dtype, implementation):
  q, kc, vc, lengths, ref = make_case(G, G=G, dtype=cache_dtype)
  out = gqa_decode(q, kc, vc, lengths, implementation=implementation)
  assert out.dtype == jnp.float32
  assert_close(out, ref, CACHE_TOL[cache_dtype], f"G={G} {cache_dtype.__name__}")


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize(
  "cache_dtype,stale",
  [
    (jnp.float32, 1e30),
    (jnp.float32, float(jnp.finfo(jnp.float32).max)),
    (jnp.bfloat16, float(jnp.finfo(jnp.bfloat16).max)),
    (jnp.float32, np.inf),
    (jnp.bfloat16, np.nan),
  ],
)
def test_stale_slots_get_zero_weight(cache_dtype, stale, implementation):
  # The statement promises finite stale values; even inf and NaN must not leak.
  q, kc, vc, lengths, ref = make_case(
    7, B=3, S=24, G=2, D=16, dtype=cache_dtype, lengths=[5, 1, 23], stale=stale
  )
  out = gqa_decode(q, kc, vc, lengths, implementation=implementation)
  assert np.all(np.isfinite(np.asarray(out)))
  assert_close(out, ref, CACHE_TOL[cache_dtype], f"stale={stale}")


@pytest.mark.parametrize("block_s,num_splits", [(16, 1), (16, 3), (32, 4), (16, 8)])
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_splits_and_blocks(block_s, num_splits, cache_dtype):
  """Several blocks per split, several splits combined in the launch, empty splits, D not a
  power of two; lengths full, odd, 1 and 0, traced under jax.jit."""
  q, kc, vc, lengths, ref = make_case(
    11, B=4, S=100, Hkv=2, G=2, D=24, dtype=cache_dtype, lengths=[100, 37, 1, 0]
  )
  run = jax.jit(
    lambda n: decode_attention.gqa_decode(
      q, kc, vc, n, scale=24**-0.5, block_s=block_s, num_splits=num_splits
    )
  )
  out = run(lengths)
  assert np.all(np.asarray(out[3]) == 0.0), "lengths 0: zeros"
  assert_close(out, ref, CACHE_TOL[cache_dtype], f"block_s={block_s} splits={num_splits}")


def test_default_num_splits():
  """The model's choices on an H200 (132 SMs): B = 8, Hkv = 8, S = 8192 fills one wave of two
  programs per SM (4 splits); B = 32 needs none; one short sequence one split; a long one many,
  each at least `min_blocks_per_split` blocks."""
  ns = lambda B, Hkv, S: decode_attention.default_num_splits(B, Hkv, S, 64, sm_count=132)
  assert ns(8, 8, 8192) == 4
  assert ns(32, 8, 8192) == ns(32, 8, 32768) == 1
  assert ns(1, 1, 10) == 1
  assert ns(1, 8, 131072) == 32  # 256 programs of 64 blocks each
  most = 8192 // (decode_attention.DEFAULTS.min_blocks_per_split * 64)
  assert ns(1, 1, 8192) == most


# ---- lengths: traced, no recompilation, edges -----------------------------------------------


@pytest.mark.parametrize("implementation", IMPLS)
def test_no_recompilation_across_lengths(implementation):
  q, kc, vc, _, _ = make_case(3, B=2, S=32, G=2, D=16, stale=None)
  # One call first: the Pallas interpreter imports a module on its first use that registers a
  # jax config option (which changes jax's tracing context once); what is tested is that new
  # lengths never recompile.
  gqa_decode(q, kc, vc, jnp.asarray([1, 1], jnp.int32), implementation=implementation)
  traces = []

  @jax.jit
  def f(q, kc, vc, lengths):
    traces.append(1)  # runs once per compilation (trace)
    return gqa_decode(q, kc, vc, lengths, implementation=implementation)

  outs = []
  for lens in ([32, 1], [5, 17], [0, 40], [3, 3]):
    lens = jnp.asarray(lens, jnp.int32)
    out = f(q, kc, vc, lens)
    assert_close(out, np_gqa(q, kc, vc, np.asarray(lens)), 5e-5, f"lengths={lens}")
    outs.append(out)
  assert len(traces) == 1, f"traced {len(traces)} times"
  assert f._cache_size() == 1


@pytest.mark.parametrize("implementation", IMPLS)
def test_zero_and_overlong_lengths(implementation):
  q, kc, vc, _, _ = make_case(4, B=3, S=20, G=4, D=16, stale=None)
  full = gqa_decode(q, kc, vc, jnp.array([20, 20, 20]), implementation=implementation)
  out = gqa_decode(q, kc, vc, jnp.array([0, 25, -3]), implementation=implementation)
  assert np.all(np.asarray(out[0]) == 0.0), "lengths = 0 gives zeros"
  assert np.all(np.asarray(out[2]) == 0.0), "negative lengths give zeros"
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(full[1]))  # > S behaves as S


@pytest.mark.parametrize("implementation", IMPLS)
def test_int64_lengths_never_wrap(implementation):
  """With x64 on, an int64 length beyond int32 behaves as S (traced: clipped before the int32
  cast); a concrete one beyond int32 is an error (it would wrap in JAX's conversion)."""
  q, kc, vc, _, _ = make_case(4, B=2, S=20, G=2, D=16, stale=None)
  full = gqa_decode(q, kc, vc, jnp.array([20, 3]), implementation=implementation)
  with jax.enable_x64(True):
    lengths = jnp.array([2**31 + 5, 3], jnp.int64)
    out = jax.jit(lambda n: gqa_decode(q, kc, vc, n, implementation=implementation))(lengths)
  # Jitted against eager: the same lengths but another compilation, so rounding may differ.
  np.testing.assert_allclose(np.asarray(out), np.asarray(full), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="lengths holds values outside int32"):
    gqa_decode(q, kc, vc, np.array([2**31 + 5, 3], np.int64), implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLS)
def test_empty_cache_gives_zeros(implementation):
  q = jnp.ones((2, 4, 8), jnp.float32)
  kc = jnp.ones((2, 0, 2, 8), jnp.bfloat16)
  out = gqa_decode(q, kc, kc, jnp.array([0, 3]), implementation=implementation)
  assert out.shape == (2, 4, 8) and out.dtype == jnp.float32
  assert np.all(np.asarray(out) == 0.0)


@pytest.mark.parametrize("implementation", IMPLS)
def test_scale(implementation):
  q, kc, vc, lengths, _ = make_case(5, B=2, S=16, G=2, D=16, stale=None)
  ref = np_gqa(q, kc, vc, np.asarray(lengths), scale=0.3)
  out = gqa_decode(q, kc, vc, lengths, scale=0.3, implementation=implementation)
  assert_close(out, ref, 5e-5, "static scale")
  f = jax.jit(lambda s: gqa_decode(q, kc, vc, lengths, scale=s, implementation=implementation))
  assert_close(f(jnp.float32(0.3)), ref, 5e-5, "traced scale")


def test_default_implementation_and_lists():
  assert REGISTRY.resolve(None).name == ("triton" if registry.pallas_supported() else "xla")
  ex = EXAMPLES[0]
  out = gqa_decode(
    jnp.asarray(ex["query"], jnp.float32),
    jnp.asarray(ex["key_cache"], jnp.float32),
    jnp.asarray(ex["value_cache"], jnp.float32),
    [2],
  )  # a list of lengths
  np.testing.assert_allclose(np.asarray(out), ex["out"], atol=5e-6)


def test_query_in_bfloat16():
  q, kc, vc, lengths, _ = make_case(6, B=2, S=16, G=2, D=16, stale=None)
  q16 = q.astype(jnp.bfloat16)
  ref = np_gqa(q16, kc, vc, np.asarray(lengths))
  for impl in IMPLS:
    assert_close(gqa_decode(q16, kc, vc, lengths, implementation=impl), ref, 5e-5, impl)


# ---- bad input -------------------------------------------------------------------------------


def _good():
  q, kc, vc, lengths, _ = make_case(8, B=2, S=8, Hkv=2, G=2, D=4, stale=None)
  return dict(query=q, key_cache=kc, value_cache=vc, lengths=lengths)


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(query=jnp.zeros((2, 4))), ValueError, "query must be [B, Hq, D] (rank 3)"),
    (dict(key_cache=jnp.zeros((2, 8, 4))), ValueError, "key_cache must be [B, S, Hkv, D]"),
    (dict(key_cache=jnp.zeros((3, 8, 2, 4))), ValueError, "key_cache has shape (3, 8, 2, 4)"),
    (dict(key_cache=jnp.zeros((2, 8, 2, 5))), ValueError, "D = 4"),
    (dict(value_cache=jnp.zeros((2, 7, 2, 4))), ValueError, "value_cache has shape (2, 7, 2, 4)"),
    (
      dict(key_cache=jnp.zeros((2, 8, 3, 4)), value_cache=jnp.zeros((2, 8, 3, 4))),
      ValueError,
      "Hq = 4 (query shape (2, 4, 4)) must be a multiple of the number of cache heads Hkv = 3",
    ),
    (
      dict(lengths=jnp.zeros((2,), jnp.float32)),
      TypeError,
      "lengths must have an integer dtype (int32), got float32 with shape (2,)",
    ),
    (dict(lengths=jnp.zeros((2,), bool)), TypeError, "lengths must have an integer dtype"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), ValueError, "lengths has shape (3,)"),
    (dict(lengths=jnp.zeros((2, 1), jnp.int32)), ValueError, "expected (2,)"),
    (dict(query=jnp.zeros((2, 4, 4), jnp.int32)), TypeError, "query must have a floating dtype"),
    (dict(value_cache=jnp.zeros((2, 8, 2, 4), jnp.bfloat16)), TypeError, "share one dtype"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  inputs = _good()
  inputs.update(change)
  with pytest.raises(error) as info:
    gqa_decode(**inputs)
  assert words in str(info.value)


def test_bad_implementation():
  with pytest.raises(ValueError, match="implementation must be one of"):
    gqa_decode(**_good(), implementation="cuda")


# ---- large shapes, compiled, on a GPU only ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float32])
def test_large_on_gpu(cache_dtype):
  q, kc, vc, lengths, ref = make_case(
    9, B=4, S=4096, Hkv=4, G=4, D=128, dtype=cache_dtype, lengths=[4096, 1, 2049, 0], stale=1e30
  )
  out = gqa_decode(q, kc, vc, lengths, implementation="pallas")
  # D = 128 sums 128 products whose query factor carries the ~2^-18 error of its bf16 split.
  big_tol = 5e-4 if cache_dtype == jnp.bfloat16 else CACHE_TOL[cache_dtype]
  assert_close(out, ref, big_tol, "pallas, large")
  out = gqa_decode(q, kc, vc, lengths, implementation="xla")
  assert_close(out, ref, CACHE_TOL[cache_dtype], "xla, large")


# ---- the Triton lowering, without a GPU ------------------------------------------------------


@pytest.mark.parametrize(
  "B,S,Hq,Hkv,D,cache_dtype",
  [
    (32, 32768, 32, 8, 128, jnp.bfloat16),  # the benchmark shape: one split
    (8, 8192, 32, 8, 128, jnp.bfloat16),  # four splits, combined in the launch
    (2, 1000, 32, 8, 128, jnp.float32),
    (3, 100, 4, 2, 24, jnp.bfloat16),  # G and D padded and masked
    (1, 3, 2, 1, 2, jnp.float32),  # the statement's first example
  ],
)
def test_kernel_lowers_to_triton(monkeypatch, B, S, Hq, Hkv, D, cache_dtype):
  spec = jax.ShapeDtypeStruct
  modules = lower_for_h200(
    monkeypatch,
    lambda q, k, v, n: decode_attention.gqa_decode(q, k, v, n, scale=0.1),
    spec((B, Hq, D), jnp.float32),
    spec((B, S, Hkv, D), cache_dtype),
    spec((B, S, Hkv, D), cache_dtype),
    spec((B,), jnp.int32),
    clear=(decode_attention.gqa_decode,),
  )
  text = modules[0]
  assert "scf.for" in text and "tt.dot" in text
  # Several splits: one counter per (sequence, head), counted after a barrier of the threads.
  block_s = decode_attention.default_block_s(cache_dtype, S)
  several = decode_attention.default_num_splits(B, Hkv, S, block_s) > 1
  assert text.count("tt.atomic_rmw add, acq_rel, gpu") == several
  assert text.count("gpu.barrier") == several
  # Two bf16 dots per product for a bf16 cache (query and weights split in high/low parts).
  assert text.count("tt.dot") == (4 if cache_dtype == jnp.bfloat16 else 2)


@pytest.mark.parametrize("B,warps", [(32, 4), (8, 8)])
def test_split_launches_take_more_warps(monkeypatch, B, warps):
  # DecodeOptions: 8 warps when the sequence is split (B = 8: 4 splits), else 4 (B = 32)
  spec = jax.ShapeDtypeStruct
  cache = spec((B, 8192, 8, 128), jnp.bfloat16)
  lower_for_h200(  # sets the lowering up for an H200
    monkeypatch,
    lambda q, k, v, n: decode_attention.gqa_decode(q, k, v, n, scale=0.1),
    spec((B, 32, 128), jnp.float32),
    cache,
    cache,
    spec((B,), jnp.int32),
    clear=(decode_attention.gqa_decode,),
  )
  call = lambda q, k, v, n: decode_attention.gqa_decode(q, k, v, n, scale=0.1)
  args = (spec((B, 32, 128), jnp.float32), cache, cache, spec((B,), jnp.int32))
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  decode_attention.gqa_decode.clear_cache()
  assert f"num_warps = {warps} : i32" in text
