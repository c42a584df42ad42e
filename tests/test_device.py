"""The device facts (pallas_kernels/common/device.py) and the jax compatibility names
(pallas_kernels/common/compat.py): pure Python, no kernel runs."""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib

import jax
import pytest

from pallas_kernels.common import compat, device

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class FakeDevice:  # the attributes of a jax.Device that device.py reads (hashable, as one is)
  platform: str
  device_kind: str
  compute_capability: str | None = None
  core_count: int | None = None


def _gpu(capability, cores=None, kind="NVIDIA GPU"):
  return FakeDevice("gpu", kind, capability, cores)


@pytest.mark.parametrize(
  "capability,expected", [("9.0", (9, 0)), ("12.0", (12, 0)), ("8.6", (8, 6)), (None, None)]
)
def test_compute_capability_is_parsed_once(capability, expected):
  assert device.compute_capability(_gpu(capability)) == expected
  assert device.describe_capability(_gpu(capability)) == (
    "unknown" if expected is None else capability
  )


def test_a_gpu_reports_its_own_facts():
  l4 = device.device_info(_gpu("8.9", cores=58, kind="NVIDIA L4"))
  assert (l4.compute_capability, l4.sm_count, l4.shared_memory_per_block) == ((8, 9), 58, 99 * 1024)
  h200 = device.device_info(_gpu("9.0", cores=132, kind="NVIDIA H200"))
  assert (h200.sm_count, h200.shared_memory_per_block) == (132, 227 * 1024)
  # a capability missing from the table gets the smallest limit of the supported GPUs
  future = device.device_info(_gpu("11.0", cores=200))
  assert future.shared_memory_per_block == device.UNKNOWN_SHARED_MEMORY


def test_off_a_gpu_the_interpreter_figures():
  cpu = device.device_info(FakeDevice("cpu", "cpu"))
  assert cpu.compute_capability is None
  assert (cpu.sm_count, cpu.shared_memory_per_block) == (
    device.INTERPRET.sm_count,
    device.INTERPRET.shared_memory_per_block,
  )
  assert device.sm_count() > 0 and device.shared_memory_per_block() > 0


def test_the_jax_range_is_pyproject_s():
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  assert f"jax>={compat.OLDEST},<={compat.NEWEST}" in deps
  assert compat.supported(), f"jax {jax.__version__} is outside {compat.OLDEST}..{compat.NEWEST}"


@pytest.mark.parametrize(
  "version,ok",
  [("0.11.1", False), ("0.11.2", True), ("0.12.0", True), ("0.12.0.1", True), ("0.12.1", False)],
)
def test_supported_versions(version, ok):
  assert compat.supported(version) is ok


def test_the_private_names_the_tests_reach_import():
  internals = compat.triton_lowering_internals()
  assert callable(internals.gpu_info.get_gpu_info_from_version)
  assert callable(internals.lowering.lower_jaxpr_to_triton_module)
  assert internals.registration.gpu_info_lib is not None
