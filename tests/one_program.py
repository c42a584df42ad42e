"""The cases of a parametrized test computed by one jitted program (CONTRIBUTING.md: on a CPU a
test's time is nearly all XLA compiling, and compiling one program of many small parts costs far
less than compiling each part on its own).

A module-scoped fixture calls `one_program(request, "test_name", case)`: `case(**params)` returns
(fn, args) for one case, `fn(*args)` traceable; the fixture gets {case id: fn(*args)} for the
cases of `test_name` that this session runs (after -m, -k and node-id selection, so the fast tier
computes its cases only), and each case's test takes its own result (`results[case_id(request)]`)
and checks it as before. Should the joint program fail, each case runs on its own and a failing
case's error is raised in its own test.
"""

from __future__ import annotations

import jax


def case_id(request) -> str:
  """The id of the running test's case (what `one_program` keys its results by)."""
  return request.node.callspec.id


class CaseResults(dict):
  """{case id: result}; a case whose computation raised raises its error when looked up."""

  def __getitem__(self, key):
    value = super().__getitem__(key)
    if isinstance(value, Exception):
      raise value
    return value


def selected(request, test_name: str) -> list:
  """(id, params) of the cases of `test_name` (a test of the requesting fixture's module, and
  of its class, if any) that this session runs."""
  return [
    (item.callspec.id, item.callspec.params)
    for item in request.session.items
    if getattr(item, "originalname", None) == test_name
    and item.module is request.module
    and getattr(item, "cls", None) is getattr(request, "cls", None)
    and hasattr(item, "callspec")
  ]


def one_program(request, test_name: str, case) -> CaseResults:
  """{case id: fn(*args)} for the selected cases of `test_name`, (fn, args) = case(**params),
  every fn run by one `jax.jit`."""
  cases = selected(request, test_name)
  ids = [i for i, _ in cases]
  built = [case(**params) for _, params in cases]
  fns = [fn for fn, _ in built]
  try:
    outs = jax.jit(lambda arg_lists: [fn(*a) for fn, a in zip(fns, arg_lists)])(
      [list(a) for _, a in built]
    )
    return CaseResults(zip(ids, outs))
  except Exception:  # run each case alone: a failing case fails its own test only
    results = CaseResults()
    for i, (fn, args) in zip(ids, built):
      try:
        results[i] = jax.jit(fn)(*args)
      except Exception as error:
        results[i] = error
    return results
