"""The registries (gdp_jax/ops/registry.py, one per op in its api.py): every implementation
reachable from every public function that lists it, the choice per device and per call, the clear
error on an unsupported GPU, and the backward switch of the Pallas forward (its gradients with
either backward: tests/test_fused_forward.py::test_operator_forward_and_gradients)."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

from gdp_jax import describe_runtime, gated_delta_product, gated_delta_product_step, gqa_decode
from gdp_jax.ops import base, registry
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.gated_delta_product.base import Problem
from gdp_jax.ops.gqa_decode.api import REGISTRY as DECODE_REGISTRY
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from pallas_kernels.common import options
from pallas_kernels.common.device import DeviceInfo
from tests.cases import assert_close, general_backends, make_inputs, tol

REGISTRIES = {
  "gated_delta_product": REGISTRY,
  "gated_delta_product_step": STEP_REGISTRY,
  "gqa_decode": DECODE_REGISTRY,
}


def _gpu(capability, kind="NVIDIA Test GPU"):
  return SimpleNamespace(platform="gpu", compute_capability=capability, device_kind=kind)


def _resolve(function, implementation, device=None, problem=None):
  return REGISTRIES[function].resolve(implementation, device, problem).name


def _recording(monkeypatch):
  """The names every registry resolves to from now on (appended to the list returned)."""
  picked = []
  resolve = registry.Registry.resolve

  def recorded(self, *args, **kwargs):
    impl = resolve(self, *args, **kwargs)
    picked.append(impl.name)
    return impl

  monkeypatch.setattr(registry.Registry, "resolve", recorded)
  return picked


@pytest.mark.parametrize(
  "device,expected",
  [
    (SimpleNamespace(platform="cpu", device_kind="cpu"), "xla"),
    (SimpleNamespace(platform="tpu", device_kind="TPU v5"), "xla"),
    (_gpu("7.5", "Tesla T4"), "xla"),
    (_gpu("8.0", "NVIDIA A100"), "triton"),
    (_gpu("8.9", "NVIDIA L4"), "triton"),
    (_gpu("9.0", "NVIDIA H200"), "triton"),
    (_gpu("12.0"), "triton"),
    (_gpu(None), "xla"),
  ],
)
def test_default_per_device(device, expected):
  # on Hopper (9.0) the operator prefers the Mosaic GPU forward; every other function, and every
  # other GPU, the Triton kernels
  hopper = expected == "triton" and getattr(device, "compute_capability", None) == "9.0"
  for function in ("gated_delta_product", "gated_delta_product_step", "gqa_decode"):
    want = "mosaic_gpu" if hopper and function == "gated_delta_product" else expected
    assert _resolve(function, None, device) == want
    if expected == "triton":  # "pallas": the best Pallas backend for the device
      assert _resolve(function, "pallas", device) == want


def test_the_first_implementation_that_takes_the_call_runs():
  # the preference list walked per call: on Hopper the Mosaic kernels take half-precision inputs
  # with K, V in 64, 128 and r in 1, 2, 4, packed or not; any other call goes on to the Triton
  # kernels, and a named implementation that cannot take it is a clear error
  h200 = _gpu("9.0", "NVIDIA H200")
  ok = Problem(jnp.bfloat16, 128, 128, 2, False)
  for taken in (ok, ok._replace(packed=True)):
    assert _resolve("gated_delta_product", None, h200, taken) == "mosaic_gpu", taken
    assert _resolve("gated_delta_product", "pallas", h200, taken) == "mosaic_gpu", taken
  for other in (
    ok._replace(dtype=jnp.float32),
    ok._replace(key_dim=32),
    ok._replace(value_dim=256),
    ok._replace(key_blocks=8),
    ok._replace(key_blocks=8, packed=True),
  ):
    assert _resolve("gated_delta_product", None, h200, other) == "triton", other
    assert _resolve("gated_delta_product", "pallas", h200, other) == "triton", other
  with pytest.raises(ValueError, match="takes bfloat16 or float16 only"):
    _resolve("gated_delta_product", "mosaic_gpu", h200, ok._replace(dtype=jnp.float32))
  with pytest.raises(ValueError, match="r = 8 key blocks"):
    _resolve("gated_delta_product", "mosaic_gpu", h200, ok._replace(key_blocks=8))
  with pytest.raises(ValueError, match=r"NVIDIA A100 \(compute capability 8\.0\)"):
    _resolve("gated_delta_product", "mosaic_gpu", _gpu("8.0", "NVIDIA A100"), ok)


def test_pallas_prefers_a_registered_backend_on_the_gpus_its_rule_names(monkeypatch):
  # a second Pallas backend: registered, "pallas" and None pick it where its rule
  # (PALLAS_PREFERENCE) accepts the GPU, and the Triton backend everywhere else
  @dataclasses.dataclass(frozen=True)
  class Mosaic(base.Implementation):
    name: ClassVar[str] = "mosaic_gpu"
    pallas: ClassVar[bool] = True

    def serves(self, capability):
      return capability == (9, 0)

  ours = registry.Registry("gated_delta_product", [REGISTRY.get(n) for n in REGISTRY.names()])
  monkeypatch.setitem(REGISTRIES, "gated_delta_product", ours)
  ours._table.pop("mosaic_gpu")
  h200 = _gpu("9.0", "NVIDIA H200")
  assert _resolve("gated_delta_product", "pallas", h200) == "triton"  # not registered
  ours.register(Mosaic(), before="triton")
  a100 = _gpu("8.0", "NVIDIA A100")
  assert _resolve("gated_delta_product", "pallas", h200) == "mosaic_gpu"
  assert _resolve("gated_delta_product", None, h200) == "mosaic_gpu"
  assert _resolve("gated_delta_product", "pallas", a100) == "triton"
  assert _resolve("gqa_decode", "pallas", h200) == "triton"  # not registered there
  assert _resolve("gated_delta_product", "triton", h200) == "triton"  # explicit: obeyed
  assert ours.names() == ("mosaic_gpu", "triton", "xla", "reference")


def test_names_in_order_of_preference_and_accepted_names():
  names = ("mosaic_gpu", "triton", "xla", "reference")
  assert REGISTRY.names() == names
  assert REGISTRY.accepted() == (*names, "pallas")
  assert DECODE_REGISTRY.names() == ("triton", "xla")
  assert REGISTRY.is_pallas("pallas") and REGISTRY.is_pallas("triton")
  assert REGISTRY.is_pallas("mosaic_gpu")
  assert not REGISTRY.is_pallas("xla") and not REGISTRY.is_pallas(None)


def test_explicit_pallas_on_an_unsupported_gpu_names_it():
  with pytest.raises(ValueError, match=r"Tesla T4 with compute capability 7\.5"):
    _resolve("gated_delta_product", "pallas", _gpu("7.5", "Tesla T4"))


def test_unknown_names_are_clear_errors():
  with pytest.raises(ValueError, match="implementation must be one of"):
    _resolve("gated_delta_product", "cuda")
  with pytest.raises(ValueError, match="implementation must be one of"):
    _resolve("gqa_decode", "reference")  # no reference decode
  with pytest.raises(ValueError, match="backward must be one of"):
    registry.check_backward("triton", REGISTRY.get("triton"))
  with pytest.raises(ValueError, match="selects the backward of the Pallas forward"):
    registry.check_backward("xla", REGISTRY.get("xla"))


@pytest.mark.parametrize("name", general_backends("gated_delta_product"))
def test_operator_reaches_every_implementation(name):
  inputs = make_inputs(0, B=1, T=9, H=1, K=16, V=16, r=2, mask_kind="head")
  # jitted: one compile per call instead of one per operation (the choice is made while tracing)
  run = functools.partial(gated_delta_product, output_final_state=True, chunk_size=16)
  o, final = jax.jit(functools.partial(run, implementation=name))(**inputs)
  o_ref, f_ref = jax.jit(functools.partial(run, implementation="reference"))(**inputs)
  assert_close(o, o_ref, tol(jnp.float32), name)
  assert_close(final, f_ref, tol(jnp.float32), name)


@pytest.mark.parametrize("name", STEP_REGISTRY.names())
def test_step_reaches_every_implementation(name):
  inputs = make_inputs(1, B=2, T=1, H=2, K=16, V=16, r=2, mask_kind="head")
  step = {n: x[:, 0] if n in ("q", "k", "v", "g", "beta") else x for n, x in inputs.items()}
  args = [step[n] for n in ("q", "k", "v", "g", "beta", "mask", "initial_state")]
  o, new = jax.jit(functools.partial(gated_delta_product_step, implementation=name))(*args)
  reference = functools.partial(gated_delta_product, output_final_state=True)
  o_ref, f_ref = jax.jit(functools.partial(reference, implementation="reference"))(**inputs)
  assert_close(o, o_ref[:, 0], tol(jnp.float32), name)
  assert_close(new, f_ref, tol(jnp.float32), name)


def test_step_default_follows_the_state_size(monkeypatch):
  # implementation=None on a supported GPU: the kernel for small states, XLA's fused step for
  # large ones (step api's PALLAS_STEP_MAX_STATE, measured on an H200); explicit names are obeyed
  from gdp_jax.ops.step import api as step_api

  monkeypatch.setattr(registry, "default_device", lambda: _gpu("9.0", "NVIDIA H200"))
  picked = _recording(monkeypatch)
  # a stand-in for both implementations' calls, (v, state) shaped like (o, new_state)
  for name in STEP_REGISTRY.names():
    monkeypatch.setattr(type(STEP_REGISTRY.get(name)), "__call__", lambda self, *a: (a[2], a[6]))
  limit = step_api.PALLAS_STEP_MAX_STATE
  for heads, expected in ((1, "triton"), (2, "xla")):
    dim = int(limit**0.5)  # one head of dim x dim: just under the limit; two heads: over it
    x = jnp.zeros((1, heads, dim), jnp.float32)
    gated_delta_product_step(x, x, x, beta=jnp.ones((1, heads)))
    assert picked[-1] == expected, (heads, picked)
  gated_delta_product_step(x, x, x, beta=jnp.ones((1, 2)), implementation="pallas")
  assert picked[-1] == "triton"


@pytest.mark.parametrize("name", DECODE_REGISTRY.names())
def test_decode_reaches_every_implementation(name):
  q = jnp.ones((1, 2, 16)) * 0.1
  kc = jnp.arange(4 * 16, dtype=jnp.float32).reshape(1, 4, 1, 16) / 64
  vc = jnp.flip(kc, axis=1)
  out = gqa_decode(q, kc, vc, jnp.array([3]), implementation=name)
  ref = gqa_decode(q, kc, vc, jnp.array([3]), implementation="xla")
  assert_close(out, ref, 1e-5, name)


def test_kernel_options_are_validated_and_used():
  with pytest.raises(ValueError, match="precision must be one of"):
    options.KernelOptions(precision="fp8")
  inputs = make_inputs(3, B=1, T=16, H=1, K=16, V=16, r=1, mask_kind=None)
  opts = options.DEFAULT.replace(chunk_state_output=options.Launch(block_v=16))
  o, _ = gated_delta_product(**inputs, chunk_size=16, implementation="pallas", options=opts)
  o_ref, _ = gated_delta_product(**inputs, implementation="reference")
  assert_close(o, o_ref, tol(jnp.float32), "options")


def test_heuristic_respects_a_smaller_gpu():
  small = DeviceInfo(
    platform="gpu",
    name="NVIDIA L4",
    compute_capability=(8, 9),
    sm_count=58,
    shared_memory_per_block=99 * 1024,
  )
  big = DeviceInfo(platform="gpu", name="NVIDIA H200", compute_capability=(9, 0))
  kw = dict(r=1, dim_k=128, dim_v=128, dtype=jnp.bfloat16)
  picked = {
    d.name: options.heuristic_options(**kw, device=d).chunk_state_output for d in (small, big)
  }
  assert picked["NVIDIA H200"] == options.DEFAULT.chunk_state_output
  assert (picked["NVIDIA L4"].num_stages, picked["NVIDIA L4"].block_v) < (3, 64)
  assert not options.over_budget(options.heuristic_options(**kw, device=small), **kw, device=small)


def test_decode_splits_follow_the_sm_count():
  from pallas_kernels.triton.inference import decode_attention

  few = decode_attention.default_num_splits(2, 2, 65536, 64, sm_count=20)
  many = decode_attention.default_num_splits(2, 2, 65536, 64, sm_count=132)
  assert few < many


@pytest.mark.parametrize(
  "device,words",
  [
    (
      SimpleNamespace(platform="cpu", device_kind="cpu"),
      "CPU (cpu): implementation=None runs 'xla'",
    ),
    (
      _gpu("9.0", "NVIDIA H200"),
      "NVIDIA H200 (compute capability 9.0): implementation=None runs 'mosaic_gpu'",
    ),
    (_gpu("7.5", "Tesla T4"), "runs 'xla'"),
  ],
)
def test_describe_runtime_names_the_device_and_the_choice(device, words):
  assert words in describe_runtime(device)


def test_float16_on_a_gpu_without_bf16_tensor_cores_runs_xla(monkeypatch):
  # a T4 (compute capability 7.5) has float16 tensor cores but not the bf16 / TF32 ones the
  # kernels are built for: None picks "xla" there for float16 inputs too, "pallas" is refused
  t4 = _gpu("7.5", "Tesla T4")
  monkeypatch.setattr(registry, "default_device", lambda: t4)
  picked = _recording(monkeypatch)
  inputs = make_inputs(4, B=1, T=16, H=1, K=16, V=16, r=2, mask_kind="head")
  half = {n: x.astype(jnp.float16) if n in ("q", "k", "v") else x for n, x in inputs.items()}
  o, _ = gated_delta_product(**half, chunk_size=16)
  assert picked == ["xla"] and o.dtype == jnp.float16
  o_ref, _ = gated_delta_product(**half, chunk_size=16, implementation="xla")
  assert_close(o, o_ref, 0.0, "float16 on a T4")
  with pytest.raises(ValueError, match=r"Tesla T4 with compute capability 7\.5"):
    gated_delta_product(**half, chunk_size=16, implementation="pallas")


def test_readme_lists_the_supported_gpus():
  import pathlib

  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  section = readme.split("## Supported GPUs", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in section.splitlines() if line.startswith("| ") and "pallas" in line]
  assert len(rows) == len(registry.SUPPORTED_GPUS)
  for gpu, row in zip(registry.SUPPORTED_GPUS, rows):
    assert row.startswith(f"| {gpu} |"), (gpu, row)
  assert "compute capability 8.0 or newer" in section
  assert registry.MIN_COMPUTE_CAPABILITY == (8, 0)


_COMPILE_ONCE = """
import jax, jax.numpy as jnp
import gdp_jax

traces = 0


@jax.jit
def f(q, k, v, beta, cu_seqlens):
  global traces
  traces += 1
  return gdp_jax.gated_delta_product(
    q, k, v, None, beta, cu_seqlens=cu_seqlens, implementation="pallas"
  )[0]


x = jnp.ones((1, 32, 1, 16)) / 8
beta = jnp.full((1, 32, 1), 0.5)
for bounds in ([0, 10, 32], [0, 12, 32]):
  f(x, x, x, beta, jnp.array(bounds, jnp.int32)).block_until_ready()
print("traces", traces)
"""


def test_a_jitted_pallas_call_compiles_once():
  # A fresh interpreter: the first Pallas call of a process must not change jax's tracing
  # context (it did when jax imported a Pallas module lazily during that call), or the second
  # call with new boundaries traces and compiles the whole function again.
  import subprocess
  import sys

  proc = subprocess.run(
    [sys.executable, "-c", _COMPILE_ONCE], capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split()[-2:] == ["traces", "1"], proc.stdout
