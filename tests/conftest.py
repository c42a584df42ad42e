"""Shared pytest set-up: the GPU switch, the `gpu` marker, the slow tier and the CPU compile level.

Kernels run compiled on a GPU backend and in the Pallas interpreter elsewhere (CI's CPUs). Tests
marked `gpu` need a compiled GPU run (large shapes that would take hours interpreted) and are
skipped, with that reason, on a CPU.

The slow tier: `SLOW` below lists, in one place, the tests marked `slow` at collection: the
end-to-end and subprocess checks (notebooks, README blocks, command lines and scripts, sharding
subprocesses, the GPU-matrix self-check) and the heavy interpreted Pallas cases; and, of the
parametrized tests `FAST_CASES` names, the cases it does not keep (one or two of each stay fast).
`make test` runs everything; `make test-fast` (`pytest -m "not slow"`) the rest. A test may also
carry `@pytest.mark.slow` itself.

Scheduling over two workers (`LONGEST_FIRST` below): each test file is one unit of work (its
tests share compiled functions), the subprocess tests of a few files units of their own, and the
longest units start first.

On a CPU-only machine (no jax GPU plugin, or JAX_PLATFORMS=cpu) the tests compile with XLA's
backend optimization level 0: the CPU tests run tiny shapes, so nearly all their time is XLA
compiling (LLVM's optimisation of the generated code), not running it; level 0 compiles about a
third faster and computes the same float32 results (no fast-math either way). The flag goes into
XLA_FLAGS before jax starts its backend, so the subprocesses the tests start (sharding checks,
notebook kernels, scripts) inherit it. An XLA_FLAGS that already sets the level is left alone.

One persistent compilation cache (jax's `jax_compilation_cache_dir`,
docs/performance.md#compile-time) serves every process of a run: the two workers and the
subprocesses the tests start, which inherit its folder through JAX_COMPILATION_CACHE_DIR. Many
tests compile programs that another test, worker or subprocess has compiled already (the training
runs of test_train_lm, the model of the notebooks, README blocks and command-line checks); those
are read back instead of compiled again. The folder is a fresh temporary one per run, removed at
its end, so a run never reads results of an earlier run; a JAX_COMPILATION_CACHE_DIR set before
pytest starts is used as it is, and GDP_TESTS_COMPILATION_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pkgutil
import re
import shutil
import tempfile

CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def _cpu_only() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",") == ["cpu"]
  # GPU plugins (CUDA, ROCm) install modules in the jax_plugins namespace package.
  spec = importlib.util.find_spec("jax_plugins")
  if spec is None or not spec.submodule_search_locations:
    return True
  return not any(True for _ in pkgutil.iter_modules(spec.submodule_search_locations))


if _cpu_only() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_COMPILE_FLAG).strip()


import jax  # noqa: E402  (after XLA_FLAGS: XLA reads them when the backend starts)
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def _share_compilation_cache() -> None:
  """One persistent compilation cache for this run's processes (module docstring)."""
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    # The first process of the run (pytest itself, or the controller of its workers, which
    # inherit the folder with the rest of the environment); removed when that process exits.
    path = tempfile.mkdtemp(prefix="gdp_jax_tests_compiled_")
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    # Every program, however quick to compile (the default keeps those over one second only).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  # Also when jax was imported before this file (it reads its environment variables then).
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")),
  )


if os.environ.get("GDP_TESTS_COMPILATION_CACHE", "1") != "0":
  _share_compilation_cache()


# Node-id patterns of the slow tier, against "tests/<file>::<test>[<params>]"; `*` is the only
# wildcard (brackets are literal).
SLOW = (
  # End to end, in subprocesses or through a command line.
  "tests/test_compile_counts.py::test_generate_prefill_by_steps_is_one_program",
  "tests/test_compile_counts.py::test_generate_traces_once_per_bucket",
  "tests/test_compilation_cache.py::test_a_second_run_compiles_nothing",
  "tests/test_prefix_cache.py::test_prefix_cache_same_tokens_fewer_computed*",
  "tests/test_models.py::test_training_step_lowers_loss",
  "tests/test_models.py::test_scanned_program_does_not_grow_with_depth",
  "tests/test_gpu_matrix.py::test_the_two_references_agree",
  "tests/test_reproducible.py::test_bitwise_across_runs_and_batch_composition*",
  "tests/test_layers.py::test_gdp_sequence_matches_steps*",
  "tests/test_implementations.py::TestXla::test_transformations_compose",
  "tests/test_varlen.py::test_jnp_backward_of_packed_form*",
  "tests/test_xla_backward.py::test_full_backward_strong_decay",
  "tests/test_xla_backward.py::test_dhu_without_dfinal",
  # Lowered for an H200 at the benchmark shape: the fast tier keeps the block states' at r = 1
  "tests/test_mosaic_gpu_impl.py::test_lowers_for_cuda_at_benchmark_shape*",
  "tests/test_mosaic_gpu_impl.py::test_block_states_lower_for_cuda[2]",
  # the in-place packed case in the Mosaic GPU interpreter (a subprocess of its own)
  "tests/test_mosaic_gpu_impl.py::test_packed_in_place_interpreted_matches_the_reference",
  "tests/test_notebooks.py::test_notebook_runs*",
  "tests/test_readme.py::test_python_block_runs_on_its_own*",
  "tests/test_sharding.py::*",
  "tests/test_partitioning.py::*",
  "tests/test_gpu_matrix.py::test_tiny_run_reports_a_planted_mismatch*",
  "tests/test_registry.py::test_a_jitted_pallas_call_compiles_once*",
  "tests/test_surface.py::test_submodules_reachable_after_import_gdp_jax*",
  "tests/test_bench.py::test_bench_command_tiny*",
  "tests/test_bench.py::test_bench_operator_script_is_a_thin_caller*",
  "tests/test_bench.py::test_bench_varlen_smoke*",
  "tests/test_nonfinite.py::test_bench_nonfinite_smoke*",
  "tests/test_paged_decode.py::test_bench_decode_smoke*",
  "tests/test_models.py::test_demo_command_runs*",
  "tests/test_models.py::test_check_command_runs*",
  "tests/test_train_lm.py::test_tiny_preset_trains_and_validation_loss_goes_down*",
  "tests/test_train_lm.py::test_checkpoint_resumes_to_the_same_step_and_loss*",
  "tests/test_train_lm.py::test_command_line_and_bad_configuration*",
  "tests/test_train_lm.py::test_profile_train_step_smoke*",
  "tests/test_train_lm.py::test_resume_says_what_it_found*",
  "tests/test_train_lm.py::test_a_killed_save_loses_only_the_unfinished_step*",
  # Heavy interpreted Pallas cases: every stage of the kernels against the jnp form, the whole
  # Pallas path's gradients where one case takes over 12 s on a 2-core CPU, and the interpreted
  # operator's cases beyond one of each kind (3 to 10 s each): the fast tier keeps its forward
  # at every mask shape and one gradient case.
  "tests/test_pallas_forward.py::test_stages_match_xla*",
  "tests/test_pallas_backward.py::test_backward_stages_match_xla*",
  "tests/test_fused_forward.py::test_chunk_fwd_matches_stages*",
  "tests/test_fused_forward.py::test_chunk_state_output_matches_stages*",
  "tests/test_fused_forward.py::test_operator_forward_and_gradients*",
  "tests/test_nonfinite.py::test_nonfinite_gradient_is_causal[triton*",
  "tests/test_nonfinite.py::test_reset_matches_reference[triton]",
  "tests/test_nonfinite.py::test_reset_is_a_fresh_start[triton]",
  "tests/test_nonfinite.py::test_pallas_guard_under_jit*",
  "tests/test_implementations.py::TestTriton::test_transformations_compose",
  # (the interpreted Triton kernels' gradients keep their cheapest case, r = 1, in the fast tier)
  "tests/test_implementations.py::TestTriton::test_gradients_match_reference[2*",
  "tests/test_implementations.py::TestTriton::test_gradients_match_reference[4*",
  "tests/test_implementations.py::TestTriton::test_gradients_half_precision*",
  "tests/test_implementations.py::TestTriton::test_forward_half_precision*",
  "tests/test_implementations.py::TestTriton::test_two_halves_thread_the_state",
  "tests/test_pallas_forward.py::test_forward_without_state_and_odd_dims",
  "tests/test_grouped_heads.py::test_grouped_equals_repeated_keys[pallas*",
  "tests/test_layers.py::test_gdp_packed_gradients_do_not_cross_documents[pallas*",
  "tests/test_varlen.py::test_pallas_packed_equals_the_reference*",
  "tests/test_varlen.py::test_pallas_non_finite_input_stays_in_its_sequence*",
  "tests/test_varlen.py::test_pallas_state_walks_run_each_sequence_apart*",
  "tests/test_householder.py::test_pallas_matches_reference*",
  "tests/test_key_block_loop.py::test_operator_with_the_loop_form_matches_the_reference*",
  "tests/test_mosaic_gpu.py::test_chunk_inverse_interpreted*",
  "tests/test_mosaic_gpu.py::test_forward_interpreted_matches_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_forward_interpreted_matches_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_gradients_interpreted_match_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_a_nan_spoils_nothing_before_it*",
  "tests/test_mosaic_gpu_impl.py::test_nonfinite_inputs_match_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_block_states_interpreted_match_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_packed_forward_interpreted_matches_the_reference*",
  "tests/test_mosaic_gpu_impl.py::test_packed_gradients_interpreted_match_the_reference*",
  "tests/test_mosaic_gpu.py::test_householder_forward_interpreted_matches_its_recurrence*",
  "tests/test_layers.py::test_gdp_step_tokens_pallas_matches_xla",
  "tests/test_varlen.py::test_chunk_fwd_in_place_equals_padded_copy",
  # the Mosaic kernels lowered for the GPU at 32k packed tokens (the fast tier lowers them at
  # one benchmark shape)
  "tests/test_mosaic_gpu_impl.py::test_packed_forward_lowers_for_cuda",
  # End to end in one process: a model training a step (the fast tier keeps the plain model's),
  # a layer's packed call and ragged prefill against separate calls (the fast tier keeps the
  # GatedDeltaProduct layer's), the example language model's packing.
  "tests/test_householder.py::test_hybrid_model_with_a_householder_layer_trains_a_step",
  "tests/test_householder.py::test_householder_layer_ragged_prefill_and_gradients",
  "tests/test_varlen.py::test_layer_packed_call_equals_separate_calls*",
  "tests/test_train_lm.py::test_packed_documents_do_not_see_each_other",
)

# One case of each: for a parametrized test named here, the fast tier runs the cases matching
# its patterns (the same check at other shapes, dtypes and mask kinds; every implementation a
# test takes where the cases name them) and the slow tier the rest. Patterns as in `SLOW`.
FAST_CASES = (
  "tests/test_block_states.py::test_packed_states_count_from_each_sequence_start[triton]",
  "tests/test_block_states.py::test_states_are_the_prefixes_final_states[xla]",
  "tests/test_decode.py::test_kernel_splits_and_blocks[bfloat16-32-4]",
  "tests/test_decode.py::test_kernel_splits_and_blocks[float32-16-3]",
  "tests/test_decode.py::test_problem_examples[*-bfloat16-xla]",
  "tests/test_decode.py::test_problem_examples[*-float32-pallas]",
  "tests/test_decode.py::test_random_against_numpy[2-float32-*",
  "tests/test_fused_forward.py::test_fused_kernels_lower_to_triton[2-32-128-128-bfloat16-True]",
  "tests/test_fused_forward.py::test_fused_kernels_lower_to_triton[8-16-128-128-float32-True]",
  "tests/test_grouped_heads.py::test_grouped_equals_repeated_keys[xla-1-3-1-None]",
  "tests/test_householder.py::test_layer_sequence_matches_steps[kw0]",
  "tests/test_householder.py::test_packed_equals_separate[reference-2-True-True]",
  "tests/test_householder.py::test_packed_one_compilation_for_new_boundaries[xla]",
  "tests/test_householder.py::test_xla_matches_reference[3-True-False]",
  "tests/test_implementations.py::TestTriton::test_forward_matches_reference[4-head-9-64]",
  "tests/test_implementations.py::TestXla::test_forward_half_precision[bfloat16]",
  "tests/test_implementations.py::TestXla::test_forward_matches_reference[1-None-45-64]",
  "tests/test_implementations.py::TestXla::test_forward_matches_reference[4-token-50-16]",
  "tests/test_implementations.py::TestXla::test_gradients_match_reference[4-head-24-True]",
  "tests/test_layers.py::test_gdp_packed_documents_match_separate_runs[token-True-lengths2]",
  "tests/test_layers.py::test_gdp_packed_gradients_do_not_cross_documents[xla-lengths0]",
  "tests/test_layers.py::test_gdp_step_tokens_matches_steps[static]",
  "tests/test_layers.py::test_gdp_step_tokens_matches_steps[token]",
  "tests/test_layers.py::test_gdp_variants_match_steps[kw0]",
  "tests/test_layers.py::test_given_callables_run_every_call[gdp]",
  "tests/test_models.py::test_step_tokens_matches_steps_and_sequence[dense]",
  "tests/test_mosaic_gpu.py::test_forward_lowers_for_cuda_at_benchmark_shape[4-shared-True]",
  "tests/test_nonfinite.py::test_nonfinite_forward_is_causal[*-k-nan]",
  "tests/test_nonfinite.py::test_nonfinite_forward_is_causal[xla-*",
  "tests/test_nonfinite.py::test_nonfinite_gradient_is_causal[xla-*",
  "tests/test_operator.py::test_all_ones_mask_is_gated_delta_rule[2-*",
  "tests/test_operator.py::test_lengths_and_mask_shapes[5-shared]",
  "tests/test_operator.py::test_lengths_and_mask_shapes[65-head]",
  "tests/test_paged_decode.py::test_dense_multi_token[5-*",
  "tests/test_paged_decode.py::test_kernel_blocks_across_and_inside_pages[16-6-64-1]",
  "tests/test_paged_decode.py::test_kernel_blocks_across_and_inside_pages[32-3-16-4]",
  "tests/test_paged_decode.py::test_paged_equals_dense[float32-*",
  "tests/test_paged_decode.py::test_paged_multi_token[bfloat16-*",
  "tests/test_pallas_backward.py::test_backward_lowers_to_triton[2-head-64-64-float32]",
  "tests/test_pallas_forward.py::test_forward_lowers_to_triton[2-head-128-128-bfloat16]",
  "tests/test_pallas_forward.py::test_forward_lowers_to_triton[8-shared-32-24-bfloat16]",
  "tests/test_step.py::test_steps_match_operator[token-2-*",
  "tests/test_varlen.py::test_packed_equals_separate[xla-2-token-1-2]",
  "tests/test_xla_backward.py::test_dhu[2-token-*",
  "tests/test_xla_backward.py::test_dqkwg[2-token-*",
  "tests/test_xla_backward.py::test_dv_local[2-token-*",
  "tests/test_xla_backward.py::test_full_backward[4-token-True-32]",
  "tests/test_xla_backward.py::test_wy_bwd[2-token-*",
)


# Scheduling under `pytest -n 2 --dist loadfile --no-loadscope-reorder` (the Makefile's test
# targets): a worker takes the next unit of tests when it is free. A unit is a test file (its
# tests share compiled functions and module-level results), except in the files of `SPLIT`,
# whose tests (independent subprocesses) are units of their own (`pytest_xdist_make_scheduler`
# below). Units start in the order of `LONGEST_FIRST` (node-id patterns as in `SLOW`; the longest
# units on a 2-core CPU first, so that no long unit starts last while the other worker idles),
# then in collection order.
SPLIT = (
  "tests/test_sharding.py",
  "tests/test_partitioning.py",
  "tests/test_notebooks.py",
  "tests/test_readme.py",
)
LONGEST_FIRST = (
  "tests/test_varlen.py::*",
  "tests/test_layers.py::*",
  "tests/test_models.py::*",
  "tests/test_implementations.py::*",
  "tests/test_mosaic_gpu_impl.py::*",
  "tests/test_householder.py::*",
  "tests/test_train_lm.py::*",
  "tests/test_partitioning.py::test_sharded_inputs_run_the_kernels_per_device",
  "tests/test_mosaic_gpu.py::*",
  "tests/test_sharding.py::test_sharding_group*",
  "tests/test_xla_backward.py::*",
  "tests/test_fused_forward.py::*",
  "tests/test_paged_decode.py::*",
  "tests/test_nonfinite.py::*",
  "tests/test_partitioning.py::test_annotated_model_trains_data_x_tensor_parallel",
  "tests/test_grouped_heads.py::*",
  "tests/test_gpu_matrix.py::*",
  "tests/test_pallas_backward.py::*",
  "tests/test_operator.py::*",
  "tests/test_decode.py::*",
  "tests/test_block_states.py::*",
  "tests/test_notebooks.py::test_notebook_runs*",
  "tests/test_bench.py::*",
  "tests/test_compile_counts.py::*",
  "tests/test_step.py::*",
  "tests/test_prefix_cache.py::*",
  "tests/test_readme.py::test_python_block_runs_on_its_own*",
  "tests/test_pallas_forward.py::*",
  "tests/test_key_block_loop.py::*",
  "tests/test_reproducible.py::*",
  "tests/test_registry.py::*",
  "tests/test_speculative.py::*",
  "tests/test_model_verify.py::*",
  "tests/test_surface.py::*",
  "tests/test_values.py::*",
)


def _pattern(patterns):
  return re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in patterns))


_SLOW_RE = _pattern(SLOW)
_FAST_CASES_RE = _pattern(FAST_CASES)
_FAST_CASES_FAMILIES = {p.split("[")[0] for p in FAST_CASES}
_FIRST_RE = [_pattern([p]) for p in LONGEST_FIRST]


def _path_id(nodeid: str) -> str:
  return nodeid.replace(os.sep, "/")


def is_slow(nodeid: str) -> bool:
  """Whether a test's node id is in the slow tier (`SLOW`, or a case `FAST_CASES` leaves out)."""
  nodeid = _path_id(nodeid)
  if _SLOW_RE.fullmatch(nodeid):
    return True
  return nodeid.split("[")[0] in _FAST_CASES_FAMILIES and not _FAST_CASES_RE.fullmatch(nodeid)


def start_rank(nodeid: str) -> int:
  """The place of a test's unit in `LONGEST_FIRST` (len(LONGEST_FIRST) when not listed)."""
  nodeid = _path_id(nodeid)
  return next((i for i, p in enumerate(_FIRST_RE) if p.fullmatch(nodeid)), len(LONGEST_FIRST))


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: large shapes, run compiled on a GPU only")


def pytest_collection_modifyitems(config, items):
  slow = pytest.mark.slow
  for item in items:
    if is_slow(item.nodeid):
      item.add_marker(slow)
  order = {id(item): (start_rank(item.nodeid), i) for i, item in enumerate(items)}
  items.sort(key=lambda item: order[id(item)])
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="large shapes run compiled on the GPU only")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


try:
  from xdist.scheduler import LoadFileScheduling
except ImportError:  # without pytest-xdist: one process, collection order
  LoadFileScheduling = None

if LoadFileScheduling is not None:

  class UnitScheduling(LoadFileScheduling):
    """`--dist loadfile`, with each test of the `SPLIT` files a unit of its own."""

    def _split_scope(self, nodeid):
      path = _path_id(nodeid).split("::")[0]
      return nodeid if path in SPLIT else super()._split_scope(nodeid)

  def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
      return UnitScheduling(config, log)
    return None
