"""Lower Pallas kernels through the Triton lowering for an H200 without a GPU (CI's CPUs).

This runs the Pallas -> Triton IR lowering (where "Unimplemented primitive", non-power-of-two
tiles and bad dots fail) and verifies the Triton module; it does not run Triton's own compiler,
so a kernel is still done only once it has compiled on the GPU (docs/pallas_triton.md).
"""

from __future__ import annotations

import jax


def lower_for_h200(monkeypatch, fn, *avals, clear=()):
  """Lower `fn(*avals)` for CUDA; returns the verified Triton modules' text.

  `clear`: jitted kernel wrappers whose trace caches must not keep (or reuse) an interpret-mode
  trace.
  """
  from pallas_kernels.common import backend, compat

  # private modules: pallas_kernels/common/compat.py imports them for every supported jax
  internals = compat.triton_lowering_internals()
  gpu_info, triton_lowering = internals.gpu_info, internals.lowering
  registration = internals.registration

  monkeypatch.setattr(backend, "interpret_mode", lambda: False)
  if jax.default_backend() != "gpu":
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  modules = []
  original = triton_lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = original(*args, **kwargs)
    assert result.module.operation.verify(), "the Triton module does not verify"
    modules.append(result.module.operation.get_asm())
    return result

  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  for f in clear:
    f.clear_cache()
  try:
    jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
  finally:
    for f in clear:
      f.clear_cache()
  assert modules, "no Pallas kernel went through the Triton lowering"
  return modules
