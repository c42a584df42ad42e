"""`gdp_jax.ops.gated_delta_product.xla_backward`: each backward stage and their composition against
`jax.vjp` of the corresponding forward stages of `gdp_jax.ops.gated_delta_product.xla` (float32,
tight), plus padded tokens, strong decay and one check against the recurrent reference's
gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax.ops.gated_delta_product import reference, xla
from gdp_jax.ops.gated_delta_product import xla_backward as xb
from gdp_jax.ops.validation import normalize_mask
from tests.cases import GRAD_TOLERANCE, assert_close, cotangents, make_inputs, tol
from tests.one_program import case_id, one_program

TOL = tol(jnp.float32)  # 2e-5 relative (max-norm): the stages agree to ~1e-6
B, H, K, V = 2, 2, 16, 8
T = 64  # a multiple of both chunks (the operator pads before)

# (r, mask kind, with initial state, chunk) of the whole backward: each r with two mask kinds,
# each mask kind at two r, both chunks and both state cases at each r (each case compiles two
# backwards). With the strong-decay (r = 4, per-head), padded and zero-cotangent (r = 2,
# per-token) tests below, every pair of r and mask kind but (1, shared), which the stage tests
# run.
CASES = [
  (1, "head", False, 32),
  (1, "token", True, 16),
  (2, "shared", True, 32),
  (2, "head", False, 16),
  (4, "shared", False, 16),
  (4, "token", True, 32),
]
STAGE_CASES = [(1, "head", True, 16), (2, "token", False, 32), (4, "shared", True, 16)]
WY_CASES = [
  (1, "shared", True, 16),
  (2, "head", False, 32),
  (2, "token", True, 32),
  (4, "token", True, 16),
]


def _nonzero(x, what):
  """A comparison against an all-zero reference would pass vacuously."""
  assert float(jnp.max(jnp.abs(x))) > 1e-3, f"{what}: reference is (nearly) zero"


def _check(got, ref, what, rtol=TOL):
  _nonzero(ref, what)
  assert got.shape == ref.shape, (what, got.shape, ref.shape)
  assert_close(got, ref, rtol, what)


STATIC = ("scale", "chunk", "r")


def _jit(fn, s):
  """Run fn(s) as one jitted program (one XLA compile instead of one per eager op)."""
  static = {n: s[n] for n in STATIC}
  arrays = {n: x for n, x in s.items() if n not in STATIC}
  return jax.jit(lambda a: fn({**static, **a}))(arrays)


def _program(fn, s, parts=False):
  """(fn, args) of tests/one_program.py for fn(s): s's arrays traced, its STATIC entries fixed;
  `parts`: s updated with what the forward computes (`_forward_parts`) inside the program."""
  static = {n: s[n] for n in STATIC}
  arrays = {n: x for n, x in s.items() if n not in STATIC}

  def run(a):
    s = {**static, **a}
    return fn({**s, **_forward_parts(s)} if parts else s)

  return run, [arrays]


def _forward_parts(s):
  """What the forward computes: gcum, beta head-major, Ai, w, u, h, v_new."""
  chunk, r = s["chunk"], s["r"]
  out = dict(
    gcum=xla.chunk_local_cumsum(xla.to_head_major(s["g"]), chunk),
    beta_hm=xla.to_head_major(s["beta"]),
  )
  out["ai"] = xla.solve_tril(
    xla.chunk_kkt(s["k"], out["beta_hm"], s["mask"], out["gcum"], chunk), chunk * r
  )
  out["w"], out["u"] = xla.recompute_w_u(
    s["k"], s["v"], out["beta_hm"], s["mask"], out["gcum"], out["ai"], chunk
  )
  out["h"], out["v_new"], _ = xla.chunk_state(
    s["k"], out["w"], out["u"], out["gcum"], s["initial_state"], chunk, chunk
  )
  return out


def _setup(seed, r, mask_kind, with_state, chunk, t_len=T, g_scale=None, parts=True):
  """Normalised inputs, cotangents do, dfinal, and (parts) everything the forward computes."""
  inp = make_inputs(
    seed, B=B, T=t_len, H=H, K=K, V=V, r=r, mask_kind=mask_kind, with_state=with_state
  )
  mask, _ = normalize_mask(inp["mask"], B, t_len, H, K)
  h0 = inp["initial_state"]
  if h0 is None:
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
  g = inp["g"] if g_scale is None else inp["g"] * g_scale
  s = dict(
    q=inp["q"],
    k=inp["k"],
    v=inp["v"],
    g=g,
    beta=inp["beta"],
    mask=mask,
    initial_state=h0,
    scale=K**-0.5,
    chunk=chunk,
    r=r,
  )
  s["do"], s["dfinal"] = cotangents(seed, (B, t_len, H, V), (B, H, K, V))
  if parts:
    s.update(_jit(_forward_parts, s))
  return s


def _state_and_output(s, q, k, w, u, gcum, h0):
  """(o, final) from chunk_state + chunk_output: what stages 1-3 differentiate."""
  h, v_new, final = xla.chunk_state(k, w, u, gcum, h0, s["chunk"], s["chunk"])
  return xla.chunk_output(q, k, v_new, h, gcum, s["scale"], s["chunk"]), final


# ---- stage 1 -----------------------------------------------------------------------------------


def _dv_local_ref(s):
  """Stage 1 from autodiff: the vjp of chunk_output with respect to v_new (h held fixed)."""
  _, vjp = jax.vjp(
    lambda vn: xla.chunk_output(s["q"], s["k"], vn, s["h"], s["gcum"], s["scale"], s["chunk"]),
    s["v_new"],
  )
  return vjp(s["do"])[0]


def _dv_local_case(s):
  got = xb.chunk_bwd_dv_local(s["q"], s["k"], s["gcum"], s["do"], s["scale"], s["chunk"], s["r"])
  return got, _dv_local_ref(s)


# The cases of each parametrized test below are computed by one jitted program
# (tests/one_program.py), the forward's parts included.
def _stage_cases(request, test_name, seed, case):
  return one_program(
    request,
    test_name,
    lambda r, mask_kind, with_state, chunk: _program(
      case, _setup(seed, r, mask_kind, with_state, chunk, parts=False), parts=True
    ),
  )


@pytest.fixture(scope="module")
def dv_local_cases(request):
  return _stage_cases(request, "test_dv_local", 1, _dv_local_case)


@pytest.mark.parametrize("r,mask_kind,with_state,chunk", STAGE_CASES)
def test_dv_local(dv_local_cases, request, r, mask_kind, with_state, chunk):
  got, ref = dv_local_cases[case_id(request)]
  _check(got, ref, "dv_local")


# ---- stage 2 -----------------------------------------------------------------------------------


def _dhu_case(s):
  chunk, r = s["chunk"], s["r"]
  _, vjp = jax.vjp(
    lambda u, h0: _state_and_output(s, s["q"], s["k"], s["w"], u, s["gcum"], h0),
    s["u"],
    s["initial_state"],
  )
  du_ref, dh0_ref = vjp((s["do"], s["dfinal"]))
  # dh[n] = dL/d(state at the end of chunk n); dh[NT-1] = dfinal. Autodiff sees it through an
  # additive perturbation of each chunk's end state, the forward run one chunk at a time.
  nt = s["q"].shape[1] // chunk

  def perturbed(eps):
    state, outs = s["initial_state"], []
    for n in range(nt):
      tok, rows = slice(n * chunk, (n + 1) * chunk), slice(n * chunk * r, (n + 1) * chunk * r)
      o, state = _state_and_output(
        s,
        s["q"][:, tok],
        s["k"][:, tok],
        s["w"][:, :, rows],
        s["u"][:, :, rows],
        s["gcum"][:, :, tok],
        state,
      )
      state = state + eps[:, :, n]
      outs.append(o)
    return jnp.concatenate(outs, axis=1), state

  eps = jnp.zeros(s["initial_state"].shape[:2] + (nt,) + s["initial_state"].shape[2:])
  _, vjp_eps = jax.vjp(perturbed, eps)
  (dh_ref,) = vjp_eps((s["do"], s["dfinal"]))
  # stage 1 from autodiff, so that this test sees stage 2 alone
  got = xb.chunk_bwd_dhu(
    s["q"], s["k"], s["w"], s["gcum"], s["do"], _dv_local_ref(s), s["dfinal"], s["scale"], chunk
  )
  return got, (dh_ref, dh0_ref, du_ref)


@pytest.fixture(scope="module")
def dhu_cases(request):
  return _stage_cases(request, "test_dhu", 2, _dhu_case)


@pytest.mark.parametrize("r,mask_kind,with_state,chunk", STAGE_CASES)
def test_dhu(dhu_cases, request, r, mask_kind, with_state, chunk):
  s = _setup(2, r, mask_kind, with_state, chunk, parts=False)
  (dh, dh0, dv_new), (dh_ref, dh0_ref, du_ref) = dhu_cases[case_id(request)]
  assert dh.shape == (B, H, T // chunk, K, V)
  np.testing.assert_array_equal(np.asarray(dh[:, :, -1]), np.asarray(s["dfinal"]))
  _check(dh, dh_ref, "dh")
  _check(dh0, dh0_ref, "d initial_state")
  _check(dv_new, du_ref, "dv_new (= du)")


def test_dhu_without_dfinal():
  s = _setup(3, 2, "head", True, 16)
  s["dfinal"] = jnp.zeros_like(s["dfinal"])
  (_, dh0_ref, du_ref) = _jit(_dhu_case, s)[1]

  @jax.jit  # one compile instead of one per operation
  def without_dfinal(q, k, w, gcum, do):
    dv_local = xb.chunk_bwd_dv_local(q, k, gcum, do, s["scale"], 16, 2)
    return xb.chunk_bwd_dhu(q, k, w, gcum, do, dv_local, None, s["scale"], 16)

  dh, dh0, dv_new = without_dfinal(s["q"], s["k"], s["w"], s["gcum"], s["do"])
  assert not np.any(np.asarray(dh[:, :, -1]))
  _check(dv_new, du_ref, "dv_new")
  _check(dh0, dh0_ref, "d initial_state")


# ---- stage 3 -----------------------------------------------------------------------------------


def _dqkwg_case(s):
  chunk, r = s["chunk"], s["r"]
  _, vjp = jax.vjp(
    lambda q, k, w, gcum: _state_and_output(s, q, k, w, s["u"], gcum, s["initial_state"]),
    s["q"],
    s["k"],
    s["w"],
    s["gcum"],
  )
  refs = vjp((s["do"], s["dfinal"]))
  dv_local = xb.chunk_bwd_dv_local(s["q"], s["k"], s["gcum"], s["do"], s["scale"], chunk, r)
  dh, _, dv_new = xb.chunk_bwd_dhu(
    s["q"], s["k"], s["w"], s["gcum"], s["do"], dv_local, s["dfinal"], s["scale"], chunk
  )
  got = xb.chunk_bwd_dqkwg(
    s["q"], s["k"], s["v_new"], s["gcum"], s["h"], dh, s["do"], dv_new, s["scale"], chunk
  )
  return got, refs


@pytest.fixture(scope="module")
def dqkwg_cases(request):
  return _stage_cases(request, "test_dqkwg", 4, _dqkwg_case)


@pytest.mark.parametrize("r,mask_kind,with_state,chunk", STAGE_CASES)
def test_dqkwg(dqkwg_cases, request, r, mask_kind, with_state, chunk):
  got, refs = dqkwg_cases[case_id(request)]
  for name, x, ref in zip(
    ("dq", "dk (o and state part)", "dw", "dgcum (o and state part)"), got, refs
  ):
    _check(x, ref, name)


# ---- stage 4 -----------------------------------------------------------------------------------


def _wy_case(s):
  chunk, r = s["chunk"], s["r"]

  def w_u(k, v, beta_hm, mask, gcum):
    ai = xla.solve_tril(xla.chunk_kkt(k, beta_hm, mask, gcum, chunk), chunk * r)
    return xla.recompute_w_u(k, v, beta_hm, mask, gcum, ai, chunk)

  _, vjp = jax.vjp(w_u, s["k"], s["v"], s["beta_hm"], s["mask"], s["gcum"])
  refs = vjp((s["dw"], s["du"]))
  args = (s["k"], s["v"], s["beta_hm"], s["mask"], s["gcum"], s["ai"], s["dw"], s["du"], chunk)
  # w, u recomputed from Ai, and taken from the forward
  return xb.wy_bwd(*args), xb.wy_bwd(*args, w=s["w"], u=s["u"]), refs


def _wy_setup(r, mask_kind, with_state, chunk):
  s = _setup(5, r, mask_kind, with_state, chunk, parts=False)
  parts, args = _program(_forward_parts, s)
  shapes = jax.eval_shape(parts, *args)
  rng = np.random.default_rng(55)
  s["dw"] = jnp.asarray(rng.standard_normal(shapes["w"].shape), jnp.float32)
  s["du"] = jnp.asarray(rng.standard_normal(shapes["u"].shape), jnp.float32)
  return s


@pytest.fixture(scope="module")
def wy_cases(request):
  return one_program(
    request,
    "test_wy_bwd",
    lambda **case: _program(_wy_case, _wy_setup(**case), parts=True),
  )


@pytest.mark.parametrize("r,mask_kind,with_state,chunk", WY_CASES)
def test_wy_bwd(wy_cases, request, r, mask_kind, with_state, chunk):
  got, got_wu, refs = wy_cases[case_id(request)]
  assert got[3].shape == _setup(5, r, mask_kind, with_state, chunk, parts=False)["mask"].shape
  for name, x, x_wu, ref in zip(("dk", "dv", "dbeta", "dmask", "dgcum"), got, got_wu, refs):
    _check(x, ref, f"wy {name}")
    _check(x_wu, ref, f"wy {name} (w, u given)")


def test_reduce_dmask_broadcasts():
  rng = np.random.default_rng(6)
  d = jnp.asarray(rng.standard_normal((2, 3, 5, 2, 2)), jnp.float32)  # [B,H,Tp,r,r]
  tm = jnp.moveaxis(d, 1, 2)  # [B,Tp,H,r,r]
  for shape, ref in (
    ((1, 1, 1, 2, 2), tm.sum((0, 1, 2), keepdims=True)),
    ((1, 1, 3, 2, 2), tm.sum((0, 1), keepdims=True)),
    ((2, 5, 3, 2, 2), tm),
    ((2, 1, 3, 2, 2), tm.sum(1, keepdims=True)),
  ):
    assert_close(xb.reduce_dmask(d, shape), ref, 1e-6, f"reduce_dmask {shape}")


# ---- stage 5 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 32])
def test_reverse_cumsum(chunk):
  x = jnp.asarray(np.random.default_rng(7).standard_normal((B, H, T)), jnp.float32)
  _, vjp = jax.vjp(lambda g: xla.chunk_local_cumsum(g, chunk), x)
  dx = jnp.asarray(np.random.default_rng(8).standard_normal((B, H, T)), jnp.float32)
  (ref,) = vjp(dx)
  _check(xb.chunk_local_reverse_cumsum(dx, chunk), ref, "reverse cumsum", 1e-6)


# ---- 6: the whole backward ---------------------------------------------------------------------

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dmask", "d initial_state")
PRIMALS = ("q", "k", "v", "g", "beta", "mask", "initial_state")


def _full_case(s, residual_ai=False):
  """(ours, autodiff's) vjp of the whole chunked forward, in one program."""
  f = lambda *a: xla.gated_delta_product_xla(*a, s["scale"], s["chunk"])
  _, vjp = jax.vjp(f, *[s[n] for n in PRIMALS])
  refs = vjp((s["do"], s["dfinal"]))
  kw = {}
  if residual_ai:
    kw["ai"] = _forward_parts(s)["ai"]
  got = xb.gated_delta_product_xla_bwd(
    *[s[n] for n in PRIMALS], s["scale"], s["chunk"], s["do"], s["dfinal"], **kw
  )
  return got, refs


@pytest.fixture(scope="module")
def full_cases(request):
  # half the cases take the forward's Ai as residual, the others recompute it
  def case(r, mask_kind, with_state, chunk):
    s = _setup(10 + r, r, mask_kind, with_state, chunk, parts=False)
    return _program(functools.partial(_full_case, residual_ai=with_state), s)

  return one_program(request, "test_full_backward", case)


@pytest.mark.parametrize("r,mask_kind,with_state,chunk", CASES)
def test_full_backward(full_cases, request, r, mask_kind, with_state, chunk):
  got, refs = full_cases[case_id(request)]
  for name, x, ref in zip(NAMES, got, refs):
    assert x.dtype == ref.dtype, name
    _check(x, ref, name)


def test_full_backward_strong_decay():
  """Decay differences beyond e^-100 inside a chunk: an unmasked exp of a positive difference
  would overflow (inf * 0 = nan); everything must stay finite and match autodiff."""
  s = _setup(20, 4, "head", True, 32, g_scale=50.0, parts=False)
  gcum = xla.chunk_local_cumsum(xla.to_head_major(s["g"]), 32)
  assert float(jnp.min(gcum)) < -100.0
  got, refs = _jit(_full_case, s)
  for name, x, ref in zip(NAMES, got, refs):
    assert np.all(np.isfinite(np.asarray(x))), name
    _check(x, ref, name)


def test_full_backward_padded_tokens():
  """T = 37 padded to 48 as the operator does (beta = 0, g = 0, zero q/k/v, the per-token mask
  padded with zeros): the gradients of the real tokens equal the recurrence's (eagerly run)."""
  r, chunk, t_len, mask_kind = 2, 16, 37, "token"
  inp = make_inputs(21, B=B, T=t_len, H=H, K=K, V=V, r=r, mask_kind=mask_kind)
  mask, _ = normalize_mask(inp["mask"], B, t_len, H, K)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, 48 - t_len)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = (pad(inp[n]) for n in ("q", "k", "v", "g", "beta"))
  mask_p = pad(mask) if mask.shape[1] != 1 else mask
  do, dfinal = cotangents(21, (B, t_len, H, V), (B, H, K, V))
  bwd = jax.jit(  # one compile instead of one per operation
    lambda *a: xb.gated_delta_product_xla_bwd(*a[:7], K**-0.5, chunk, *a[7:])
  )
  got = bwd(q, k, v, g, beta, mask_p, inp["initial_state"], pad(do), dfinal)
  for name, x in zip(NAMES, got):
    assert np.all(np.isfinite(np.asarray(x))), name

  def loss(q, k, v, g, beta, mask, h0):
    o, final = reference.gated_delta_product_reference(q, k, v, g, beta, mask, h0, K**-0.5)
    return jnp.sum(o * do) + jnp.sum(final * dfinal)

  refs = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(
    inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], mask, inp["initial_state"]
  )
  cut = lambda x: x[:, :t_len]
  got = [cut(x) for x in got[:5]] + [cut(got[5]) if mask.shape[1] != 1 else got[5], got[6]]
  for name, x, ref in zip(NAMES, got, refs):
    _check(x, ref, f"{name} vs recurrence", GRAD_TOLERANCE[jnp.float32])


def test_full_backward_zero_cotangents_give_zero():
  s = _setup(22, 2, "token", True, 16, parts=False)
  s["do"], s["dfinal"] = jnp.zeros_like(s["do"]), jnp.zeros_like(s["dfinal"])
  got, _ = _jit(_full_case, s)
  for name, x in zip(NAMES, got):
    assert not np.any(np.asarray(x)), name
