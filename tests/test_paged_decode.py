"""`paged_gqa_decode` and multi-token queries (docs/inference.md#paged-kv-cache).

Paged equals dense (random, shuffled, shared pages; lengths 0, 1, on a page boundary and beyond
the capacity; stale and unused slots full of NaN), multi-token queries of both decode functions
against a float64 softmax written here, one compilation across tables and lengths, argument
errors, and the kernel through the Triton lowering. Every implementation everywhere ("pallas"
runs in interpret mode on CPU, so the shapes are tiny)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gqa_decode, paged_gqa_decode
from gdp_jax.ops import registry
from gdp_jax.ops.gqa_decode.api import PAGED_REGISTRY, REGISTRY
from pallas_kernels.triton.inference import decode_attention, paged_decode_attention
from tests.cases import assert_close
from tests.one_program import case_id, one_program
from tests.triton_lowering import lower_for_h200

PAGED_IMPLS = list(PAGED_REGISTRY.names())
DENSE_IMPLS = list(REGISTRY.names())
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-4}


def np_attention(query, key, value, lengths, scale=None):
  """Float64 softmax attention of Tq new tokens over a dense cache, written out here:
  query [B, Tq, Hq, D], key/value [B, C, Hkv, D]; token t of sequence b (L = clip(lengths[b],
  0, C)) sees positions j <= L - Tq + t; a token that sees nothing gets zeros."""
  q = np.asarray(jnp.asarray(query, jnp.float32), np.float64)
  k = np.asarray(jnp.asarray(key, jnp.float32), np.float64)
  v = np.asarray(jnp.asarray(value, jnp.float32), np.float64)
  B, Tq, Hq, D = q.shape
  C, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  scale = D**-0.5 if scale is None else scale
  out = np.zeros(q.shape)
  for b in range(B):
    L = int(np.clip(int(lengths[b]), 0, C))
    for t in range(Tq):
      n = L - Tq + t + 1  # positions 0 .. n - 1
      if n <= 0:
        continue
      for h in range(Hq):
        s = scale * (k[b, :n, h // G] @ q[b, t, h])
        w = np.exp(s - s.max())
        out[b, t, h] = (w / w.sum()) @ v[b, :n, h // G]
  return out


def make_paged(
  seed,
  lengths,
  *,
  page_size=16,
  max_pages=4,
  num_pages=None,
  Hkv=2,
  G=2,
  D=16,
  Tq=None,
  dtype=jnp.float32,
  share=True,
  stale=np.nan,
):
  """Random pages and a shuffled block table: sequences own distinct pages except (share) the
  later sequences' first page, which is the first page of sequence 0 (a shared prompt prefix,
  full in every sequence that uses it). Unused table entries hold garbage (-1 or a huge id);
  every slot no sequence uses holds `stale`. Returns the arrays and the dense caches
  key_pages[table] (before the stale fill: the float64 reference never sees stale slots)."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths, np.int64)
  B = len(lengths)
  num_pages = B * max_pages + 3 if num_pages is None else num_pages
  order = rng.permutation(num_pages)
  table = order[: B * max_pages].reshape(B, max_pages).copy()
  capacity = max_pages * page_size
  used = -(-np.clip(lengths, 0, capacity) // page_size)
  if share and B > 1 and used[0] >= 1 and lengths[0] >= page_size:
    for b in range(1, B):
      if lengths[b] >= page_size:
        table[b, 0] = table[0, 0]
  for b in range(B):  # garbage in the entries the lengths do not reach
    table[b, used[b] :] = rng.choice([-1, 10**6], size=max_pages - used[b])
  shape = (num_pages, page_size, Hkv, D)
  kp = np.array(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
  vp = np.array(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
  safe = np.clip(table, 0, num_pages - 1)
  dense_k = kp[safe].reshape(B, capacity, Hkv, D)
  dense_v = vp[safe].reshape(B, capacity, Hkv, D)
  live = np.zeros((num_pages, page_size), bool)
  for b in range(B):
    for p in range(int(np.clip(lengths[b], 0, capacity))):
      live[table[b, p // page_size], p % page_size] = True
  kp[~live], vp[~live] = stale, stale
  q_shape = (B, Hkv * G, D) if Tq is None else (B, Tq, Hkv * G, D)
  q = rng.standard_normal(q_shape).astype(np.float32) * 2.0
  arrays = dict(
    query=jnp.asarray(q),
    key_pages=jnp.asarray(kp, dtype),
    value_pages=jnp.asarray(vp, dtype),
    block_tables=jnp.asarray(table, jnp.int32),
    lengths=jnp.asarray(lengths, jnp.int32),
  )
  return arrays, dense_k, dense_v


def as_tokens(q):
  return q[:, None] if q.ndim == 3 else q


def reference(arrays, dense_k, dense_v, scale=None):
  q = arrays["query"]
  out = np_attention(as_tokens(q), dense_k, dense_v, np.asarray(arrays["lengths"]), scale)
  return out.reshape(q.shape)


# ---- paged equals dense ------------------------------------------------------------------------

# 0, 1, a page boundary (32), inside a page, beyond the capacity (64).
LENGTHS = [40, 0, 1, 32, 17, 100]


def _paged(implementation, arrays):
  """(fn, args) of `one_program` (tests/one_program.py): paged_gqa_decode on `arrays`."""
  names = tuple(arrays)
  call = lambda *a: paged_gqa_decode(**dict(zip(names, a)), implementation=implementation)
  return call, tuple(arrays.values())


# Each parametrized test's cases below are computed by one jitted program.
@pytest.fixture(scope="module")
def paged_cases(request):
  return one_program(
    request,
    "test_paged_equals_dense",
    lambda implementation, dtype: _paged(implementation, make_paged(0, LENGTHS, dtype=dtype)[0]),
  )


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_equals_dense(paged_cases, request, implementation, dtype):
  arrays, dense_k, dense_v = make_paged(0, LENGTHS, dtype=dtype)
  out = paged_cases[case_id(request)]
  assert out.dtype == jnp.float32 and out.shape == arrays["query"].shape
  assert np.all(np.asarray(out[1]) == 0.0), "lengths 0: zeros"
  assert_close(out, reference(arrays, dense_k, dense_v), TOL[dtype], implementation)
  # the same numbers as gqa_decode on the gathered cache (stale slots and all)
  safe = jnp.clip(arrays["block_tables"], 0, arrays["key_pages"].shape[0] - 1)
  B, P = safe.shape
  gather = lambda pages: pages[safe].reshape(B, P * pages.shape[1], *pages.shape[2:])
  dense = gqa_decode(
    arrays["query"],
    gather(arrays["key_pages"]),
    gather(arrays["value_pages"]),
    arrays["lengths"],
    implementation="xla",
  )
  assert_close(out, dense, TOL[dtype], f"{implementation} vs dense")


def _blocks_case(page_size, max_pages):
  return make_paged(1, [96, 33, 3, 0], page_size=page_size, max_pages=max_pages, G=3, D=24)


@pytest.fixture(scope="module")
def block_cases(request):
  def case(page_size, max_pages, block_s, num_splits):
    kernel = lambda *a: paged_decode_attention.paged_gqa_decode(
      *a, scale=24**-0.5, block_s=block_s, num_splits=num_splits
    )
    return kernel, tuple(_blocks_case(page_size, max_pages)[0].values())

  return one_program(request, "test_kernel_blocks_across_and_inside_pages", case)


@pytest.mark.parametrize(
  "page_size,max_pages,block_s,num_splits",
  [(16, 6, 16, 3), (16, 6, 64, 1), (32, 3, 16, 4), (64, 2, 32, 2)],
)
def test_kernel_blocks_across_and_inside_pages(
  block_cases, request, page_size, max_pages, block_s, num_splits
):
  """A block of rows spans several pages (block_s > page_size) or a part of one, several
  splits, empty splits, D not a power of two, G = 3 query heads padded."""
  arrays, dense_k, dense_v = _blocks_case(page_size, max_pages)
  out = block_cases[case_id(request)]
  assert_close(out, reference(arrays, dense_k, dense_v), TOL[jnp.float32], "kernel")


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
def test_shared_and_reused_pages(implementation):
  """Every sequence points at the same pages (one prompt, many samples), in another order
  than they were written."""
  arrays, _, _ = make_paged(2, [48, 48, 48], max_pages=3, share=False, stale=0.0)
  table = jnp.asarray([[5, 2, 7], [5, 2, 7], [5, 2, 7]], jnp.int32)
  arrays["block_tables"] = table
  kp, vp = np.asarray(arrays["key_pages"]), np.asarray(arrays["value_pages"])
  dense = [p[np.asarray(table)].reshape(3, 48, *p.shape[2:]) for p in (kp, vp)]
  out = paged_gqa_decode(**arrays, implementation=implementation)
  assert_close(out, reference(arrays, *dense), TOL[jnp.float32], implementation)


# ---- multi-token queries -----------------------------------------------------------------------


def _multi_token_case(dtype):
  return make_paged(3, [40, 0, 3, 32, 17, 100], Tq=3, dtype=dtype)


@pytest.fixture(scope="module")
def multi_token_cases(request):
  return one_program(
    request,
    "test_paged_multi_token",
    lambda implementation, dtype: _paged(implementation, _multi_token_case(dtype)[0]),
  )


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_multi_token(multi_token_cases, request, implementation, dtype):
  arrays, dense_k, dense_v = _multi_token_case(dtype)
  out = multi_token_cases[case_id(request)]
  assert out.shape == arrays["query"].shape
  assert np.all(np.asarray(out[1]) == 0.0)
  assert_close(out, reference(arrays, dense_k, dense_v), TOL[dtype], implementation)


def dense_case(seed, lengths, Tq, S=40, Hkv=2, G=2, D=16, stale=np.nan):
  rng = np.random.default_rng(seed)
  B = len(lengths)
  q = jnp.asarray(rng.standard_normal((B, Tq, Hkv * G, D)).astype(np.float32) * 2.0)
  kc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
  vc = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
  ref = np_attention(q, kc, vc, lengths)
  for b, n in enumerate(lengths):
    kc[b, max(n, 0) :], vc[b, max(n, 0) :] = stale, stale
  return q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(lengths, jnp.int32), ref


@pytest.fixture(scope="module")
def dense_cases(request):
  def case(implementation, Tq):
    call = lambda *a: gqa_decode(*a, implementation=implementation)
    return call, dense_case(4, [40, 0, 5, 23, 60], Tq)[:4]

  return one_program(request, "test_dense_multi_token", case)


@pytest.mark.parametrize("implementation", DENSE_IMPLS)
@pytest.mark.parametrize("Tq", [2, 5])
def test_dense_multi_token(dense_cases, request, implementation, Tq):
  q, kc, vc, lengths, ref = dense_case(4, [40, 0, 5, 23, 60], Tq)
  out = dense_cases[case_id(request)]
  assert out.shape == q.shape and out.dtype == jnp.float32
  assert_close(out, ref, 5e-5, f"Tq={Tq}")


@pytest.fixture(scope="module")
def dense_split_cases(request):
  def case(block_s, num_splits):
    kernel = lambda *a: decode_attention.gqa_decode(
      *a, scale=24**-0.5, block_s=block_s, num_splits=num_splits
    )
    return kernel, dense_case(5, [40, 18, 7], 6, G=3, D=24)[:4]

  return one_program(request, "test_dense_kernel_multi_token_splits", case)


@pytest.mark.parametrize("block_s,num_splits", [(16, 1), (16, 3), (32, 2)])
def test_dense_kernel_multi_token_splits(dense_split_cases, request, block_s, num_splits):
  """Rows whose causal limit ends inside a block, or before a whole split."""
  *_, ref = dense_case(5, [40, 18, 7], 6, G=3, D=24)
  out = dense_split_cases[case_id(request)]
  assert_close(out, ref, 5e-5, "kernel")


def test_launch_fits_shared_memory():
  """The kernels' shared memory on sm_90 (`shared_memory_bytes`: the 279,040 bytes an H200
  reported for 64 new tokens of 2 query heads over a float32 cache at D = 256, block_s 32, 3
  stages, beyond its 232,448; about 78 KB in an offline compile for a bf16 cache at D = 128, 4
  query rows, block_s 64) and the launches `fit_launch` plans for them."""
  assert decode_attention.shared_memory_bytes(16, 128, 64, 3, 2) == 78_336
  assert decode_attention.shared_memory_bytes(128, 256, 32, 3, 4) == 279_040
  limit = 232_448
  assert decode_attention.fit_launch(1, 4, 128, 2, 64, 3, limit) == (1, 64, 3)
  assert decode_attention.fit_launch(64, 2, 256, 4, 32, 3, limit) == (32, 32, 3)
  tokens, block_s, stages = decode_attention.fit_launch(1, 64, 512, 4, 32, 3, limit)
  assert tokens == 1 and (block_s, stages) != (32, 3)
  assert decode_attention.shared_memory_bytes(64, 512, block_s, stages, 4) <= limit


def _pieces_case(paged):
  """64 new tokens of 2 query heads at D = 256 over a float32 cache: two launches of 32 tokens
  (`fit_launch`); a length below 64 leaves the first tokens seeing nothing."""
  lengths = [80, 70, 40]
  if paged:
    arrays, dense_k, dense_v = make_paged(8, lengths, max_pages=5, Hkv=1, D=256, Tq=64)
    out = paged_decode_attention.paged_gqa_decode(**arrays, scale=0.05)
    return out, reference(arrays, dense_k, dense_v, scale=0.05)
  q, kc, vc, lengths, ref = dense_case(8, lengths, 64, S=80, Hkv=1, D=256)
  out = decode_attention.gqa_decode(q, kc, vc, lengths, scale=256**-0.5)
  return out, ref


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_many_new_tokens_run_in_pieces(paged):
  out, ref = _pieces_case(paged)
  assert_close(out, ref, 5e-5, "pieces")


@pytest.mark.parametrize("implementation", DENSE_IMPLS)
def test_one_token_forms_agree(implementation):
  """[B, Hq, D] and [B, 1, Hq, D] give the same numbers (today's behaviour kept)."""
  q, kc, vc, lengths, _ = dense_case(6, [40, 0, 9], 1)
  three = gqa_decode(q[:, 0], kc, vc, lengths, implementation=implementation)
  four = gqa_decode(q, kc, vc, lengths, implementation=implementation)
  assert three.shape == q[:, 0].shape and four.shape == q.shape
  np.testing.assert_array_equal(np.asarray(four[:, 0]), np.asarray(three))


@pytest.mark.parametrize("implementation", DENSE_IMPLS)
def test_traced_lengths_below_tq_give_zero_rows(implementation):
  """Under jit a length below Tq is not an error: the tokens at negative positions see nothing
  (zero rows), the others see what they can."""
  q, kc, vc, _, _ = dense_case(7, [40, 40], 4, stale=0.0)
  lengths = jnp.asarray([2, 40], jnp.int32)
  out = jax.jit(lambda n: gqa_decode(q, kc, vc, n, implementation=implementation))(lengths)
  ref = np_attention(q, kc, vc, np.asarray(lengths))
  assert np.all(np.asarray(out[0, :2]) == 0.0)
  assert_close(out, ref, 5e-5, "traced lengths < Tq")


# ---- traced tables and lengths: one compilation -----------------------------------------------


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
def test_one_compilation_across_tables_and_lengths(implementation):
  cases = [make_paged(s, lens, stale=0.0) for s, lens in ((10, [64, 1]), (11, [17, 0]))]
  cases.append(make_paged(12, [33, 100], share=False, stale=0.0))
  first = cases[0][0]
  paged_gqa_decode(**first, implementation=implementation)  # the interpreter's first-use import
  traces = []

  @jax.jit
  def f(query, key_pages, value_pages, block_tables, lengths):
    traces.append(1)  # runs once per trace (compilation)
    return paged_gqa_decode(
      query, key_pages, value_pages, block_tables, lengths, implementation=implementation
    )

  for arrays, dense_k, dense_v in cases:
    out = f(**arrays)
    assert_close(out, reference(arrays, dense_k, dense_v), 5e-5, str(arrays["lengths"]))
  assert len(traces) == 1, f"traced {len(traces)} times"
  assert f._cache_size() == 1


# ---- scale, derivatives, signature ------------------------------------------------------------


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
def test_scale_static_and_traced(implementation):
  arrays, dense_k, dense_v = make_paged(13, [20, 50], stale=0.0)
  ref = reference(arrays, dense_k, dense_v, scale=0.3)
  out = paged_gqa_decode(**arrays, scale=0.3, implementation=implementation)
  assert_close(out, ref, 5e-5, "static")
  f = jax.jit(lambda s: paged_gqa_decode(**arrays, scale=s, implementation=implementation))
  assert_close(f(jnp.float32(0.3)), ref, 5e-5, "traced")


def test_derivatives():
  arrays, _, _ = make_paged(14, [20, 50], stale=0.0)
  rest = {k: v for k, v in arrays.items() if k != "query"}
  with pytest.raises(NotImplementedError, match="paged_gqa_decode with implementation='pallas'"):
    jax.grad(lambda q: paged_gqa_decode(q, **rest, implementation="pallas").sum())(arrays["query"])
  g = jax.grad(lambda q: paged_gqa_decode(q, **rest, implementation="xla").sum())(arrays["query"])
  assert np.all(np.isfinite(np.asarray(g)))


def test_signature_and_docstring():
  sig = inspect.signature(paged_gqa_decode)
  assert list(sig.parameters) == [
    "query",
    "key_pages",
    "value_pages",
    "block_tables",
    "lengths",
    "scale",
    "implementation",
  ]
  assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
  assert "block_tables" in (paged_gqa_decode.__doc__ or "")
  assert PAGED_REGISTRY.resolve(None).name == ("triton" if registry.pallas_supported() else "xla")


# ---- bad input ---------------------------------------------------------------------------------


def _good():
  arrays, _, _ = make_paged(15, [20, 50], stale=0.0)
  return arrays


@pytest.mark.parametrize(
  "change,error,words",
  [
    (
      dict(key_pages=jnp.zeros((11, 24, 2, 16)), value_pages=jnp.zeros((11, 24, 2, 16))),
      ValueError,
      "page_size (key_pages.shape[1], shape (11, 24, 2, 16)) must be a power of two >= 16, got 24",
    ),
    (
      dict(key_pages=jnp.zeros((11, 8, 2, 16)), value_pages=jnp.zeros((11, 8, 2, 16))),
      ValueError,
      "must be a power of two >= 16, got 8",
    ),
    (dict(key_pages=jnp.zeros((11, 16, 16))), ValueError, "key_pages must be [num_pages"),
    (dict(key_pages=jnp.zeros((11, 16, 2, 8))), ValueError, "with D = 16"),
    (dict(value_pages=jnp.zeros((10, 16, 2, 16))), ValueError, "value_pages has shape"),
    (dict(value_pages=jnp.zeros((11, 16, 2, 16), jnp.bfloat16)), TypeError, "share one dtype"),
    (
      dict(block_tables=jnp.zeros((2, 4), jnp.float32)),
      TypeError,
      "block_tables must have an integer dtype (int32 page ids), got float32 with shape (2, 4)",
    ),
    (
      dict(block_tables=jnp.zeros((3, 4), jnp.int32)),
      ValueError,
      "[B, max_pages] = [2, max_pages]",
    ),
    (dict(block_tables=jnp.zeros((8,), jnp.int32)), ValueError, "got shape (8,)"),
    (
      dict(block_tables=jnp.asarray([[0, 1, 2, 3], [4, 5, 11, 6]], jnp.int32)),
      ValueError,
      "block_tables[1, 2] = 11 is not a page id: key_pages has num_pages = 11",
    ),
    (
      dict(block_tables=jnp.asarray([[-1, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)),
      ValueError,
      "block_tables[0, 0] = -1 is not a page id",
    ),
    (dict(lengths=jnp.zeros((2,), jnp.float32)), TypeError, "lengths must have an integer dtype"),
    (dict(query=jnp.zeros((2, 3, 4, 16, 1))), ValueError, "(rank 4: Tq new tokens"),
    (
      dict(query=jnp.zeros((2, 3, 4, 16)), lengths=jnp.asarray([20, 2], jnp.int32)),
      ValueError,
      "lengths[1] = 2 is smaller than the Tq = 3 new tokens",
    ),
    (dict(query=jnp.zeros((2, 65, 4, 16))), ValueError, "holds only 64 positions"),
    (dict(query=jnp.zeros((2, 3, 16))), ValueError, "Hq = 3"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  inputs = _good()
  assert inputs["key_pages"].shape == (11, 16, 2, 16)
  inputs.update(change)
  with pytest.raises(error) as info:
    paged_gqa_decode(**inputs)
  assert words in str(info.value)


def test_unused_entries_may_hold_anything():
  """Lengths [20, 50]: row 0 uses two entries only; -7 and 10**9 in the other two are no error
  and change nothing (the same numbers as the row's own pages there, and the reference's)."""
  arrays, dense_k, dense_v = make_paged(15, [20, 50], stale=np.nan)
  table = np.asarray(arrays["block_tables"])
  tidy, garbage = table.copy(), table.copy()
  tidy[0, 2:] = table[0, :2]
  garbage[0, 2:] = [-7, 10**9]
  outs = [
    np.asarray(paged_gqa_decode(**{**arrays, "block_tables": jnp.asarray(t, jnp.int32)}))
    for t in (garbage, tidy)
  ]
  assert np.all(np.isfinite(outs[0]))
  np.testing.assert_array_equal(outs[0], outs[1])
  assert_close(outs[0], reference(arrays, dense_k, dense_v), TOL[jnp.float32], "garbage entries")


def test_dense_tq_policy_errors():
  q, kc, vc, _, _ = dense_case(16, [40, 40], 3, stale=0.0)
  with pytest.raises(ValueError, match=r"lengths\[0\] = 2 is smaller than the Tq = 3"):
    gqa_decode(q, kc, vc, jnp.asarray([2, 40]))
  with pytest.raises(ValueError, match="holds only 40 positions"):
    gqa_decode(jnp.zeros((2, 41, 4, 16)), kc, vc, jnp.asarray([40, 40]))
  gqa_decode(q, kc, vc, jnp.asarray([0, 60]))  # 0 (idle) and > S (clipped to S) are fine


# ---- large shapes, compiled, on a GPU only ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("Tq", [None, 4])
def test_large_on_gpu(dtype, Tq):
  lengths = [4096, 1 if Tq is None else 0, 2049, 0, 4000, 16]
  arrays, dense_k, dense_v = make_paged(
    9, lengths, page_size=16, max_pages=256, Hkv=4, G=4, D=128, Tq=Tq, dtype=dtype
  )
  ref = reference(arrays, dense_k, dense_v)
  # D = 128 sums 128 products whose query factor carries the ~2^-18 error of its bf16 split.
  tol = 5e-4 if dtype == jnp.bfloat16 else TOL[dtype]
  assert_close(paged_gqa_decode(**arrays, implementation="pallas"), ref, tol, "pallas, large")
  assert_close(paged_gqa_decode(**arrays, implementation="xla"), ref, TOL[dtype], "xla, large")


# ---- the Triton lowering, without a GPU --------------------------------------------------------


@pytest.mark.parametrize(
  "B,max_pages,page_size,num_pages,Tq,Hq,Hkv,D,dtype",
  [
    (32, 2048, 16, 65536, None, 32, 8, 128, jnp.bfloat16),  # the benchmark shape, S = 32768
    (8, 128, 64, 1024, 4, 32, 8, 128, jnp.bfloat16),  # 4 new tokens: 16 query rows
    (3, 5, 32, 20, 3, 6, 2, 24, jnp.float32),  # rows and D padded, float32
  ],
)
def test_paged_kernel_lowers_to_triton(
  monkeypatch, B, max_pages, page_size, num_pages, Tq, Hq, Hkv, D, dtype
):
  spec = jax.ShapeDtypeStruct
  q_shape = (B, Hq, D) if Tq is None else (B, Tq, Hq, D)
  modules = lower_for_h200(
    monkeypatch,
    lambda *a: paged_decode_attention.paged_gqa_decode(*a, scale=0.1),
    spec(q_shape, jnp.float32),
    spec((num_pages, page_size, Hkv, D), dtype),
    spec((num_pages, page_size, Hkv, D), dtype),
    spec((B, max_pages), jnp.int32),
    spec((B,), jnp.int32),
    clear=(paged_decode_attention.paged_gqa_decode,),
  )
  text = modules[0]
  assert "scf.for" in text and "tt.dot" in text
  assert text.count("tt.dot") == (4 if dtype == jnp.bfloat16 else 2)


def test_dense_kernel_multi_token_lowers_to_triton(monkeypatch):
  spec = jax.ShapeDtypeStruct
  modules = lower_for_h200(
    monkeypatch,
    lambda *a: decode_attention.gqa_decode(*a, scale=0.1),
    spec((8, 4, 32, 128), jnp.float32),
    spec((8, 8192, 8, 128), jnp.bfloat16),
    spec((8, 8192, 8, 128), jnp.bfloat16),
    spec((8,), jnp.int32),
    clear=(decode_attention.gqa_decode,),
  )
  assert "scf.for" in modules[0] and modules[0].count("tt.dot") == 4


# ---- the benchmark's smoke run -----------------------------------------------------------------


def test_bench_decode_smoke(tmp_path):
  """`benchmarks/bench_decode.py --smoke` runs the paged cases, the current design beside the
  previous one, and writes its JSON (what the GPU run records: date, jax version, GPU name,
  command); every case agrees with the jnp output."""
  import importlib.util
  import json
  import pathlib

  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_decode.py"
  spec = importlib.util.spec_from_file_location("bench_decode", path)
  bench_decode = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench_decode)
  out = tmp_path / "decode.json"
  args = ["--smoke", "--out", str(out), "--reps", "1", "--inner", "1"]
  args += ["--sections", "decode,paged_sweep", "--impls", "paged,paged_previous,jax_paged"]
  assert bench_decode.main(args) == 0
  results = json.loads(out.read_text())
  for field in ("date", "jax_version", "gpu_name", "command", "goals"):
    assert field in results, field
  assert "--smoke" in results["command"]
  cases = results["decode"] + results["decode_sweep"]
  assert {c["impl"] for c in cases} >= {"paged", "paged_previous"}
  assert results["current_vs_previous"], "the current and the previous design side by side"
  for case in cases:
    if case["impl"] == "jax_paged" and not results["jax_peers"]["paged_attention"]:
      continue
    assert "error" not in case, case.get("error")
    assert case["TBps"] > 0 and case["max_abs_diff_vs_xla"] < 1e-2, case


# ---- the hybrid model's generate with a paged cache -------------------------------------------


def _tiny_model(layer_pattern="DA"):
  from flax import nnx

  from gdp_jax.models import HybridConfig, HybridLM

  config = HybridConfig(
    vocab_size=13,
    hidden_size=16,
    layer_pattern=layer_pattern,
    num_heads=2,
    head_dim=8,
    num_blocks=2,
    mask_mode="token",
    attn_num_heads=4,
    attn_num_kv_heads=2,
    mlp_ratio=2,
    chunk_size=16,
    implementation="xla",
  )
  return HybridLM(config, rngs=nnx.Rngs(0))


def test_generate_with_paged_cache_equals_dense():
  """Prompts of lengths 3, 14 and 1; the decode crosses a page boundary (position 16)."""
  from gdp_jax.models import generate

  model = _tiny_model("DAA")
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5], [6]]
  dense = generate(model, prompts, 6, pad_to=16)
  paged = generate(model, prompts, 6, pad_to=16, page_size=16)
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense))
  with pytest.raises(ValueError, match="page_size must be None or a power of two >= 16"):
    generate(model, prompts, 2, page_size=24)


@pytest.mark.parametrize("implementation", DENSE_IMPLS)
def test_paged_model_step_equals_dense_step(implementation):
  """Prefill, move the attention cache into pages, then decode steps: the logits of the paged
  and the dense caches agree step by step (the attention through either implementation)."""
  from flax import nnx

  from gdp_jax.models import PagedKVCache, to_paged

  model = _tiny_model("A")
  model.blocks[0].mixer.implementation = implementation
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4], [5] * 16], jnp.int32)
  lengths = jnp.asarray([15, 2], jnp.int32)
  _, dense = nnx.jit(lambda m, t, n: m.prefill(t, n, cache_size=32))(model, tokens, lengths)
  paged = (to_paged(dense[0], 16),)
  assert isinstance(paged[0], PagedKVCache) and paged[0].key_pages.shape == (4, 16, 2, 4)
  step = nnx.jit(lambda m, t, c: m.step(t, c))
  for i in range(3):  # sequence 0 writes positions 15, 16, 17: across a page boundary
    token = jnp.asarray([7 + i, 3], jnp.int32)
    dense_logits, dense = step(model, token, dense)
    paged_logits, paged = step(model, token, paged)
    assert_close(paged_logits, dense_logits, 1e-5, f"step {i}")
  np.testing.assert_array_equal(np.asarray(paged[0].lengths), [18, 5])
