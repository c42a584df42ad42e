"""What an implementation of an op is: a frozen dataclass whose fields are its config.

After tokamax's `Op`: the object is hashable (its config can be a static argument of `jax.jit` and
of `jax.custom_vjp`), `replace` returns a copy with other config, and each op's registry
(gdp_jax/ops/registry.py, kept in the op's `api.py`) lists instances with the default config in
order of preference (docs/implementations.md#registering-an-implementation).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One backend of one op. Subclasses set the class attributes and add their config as fields.

  name: the implementation's name in its op's registry ("reference", "xla", "triton", ...).
  summary: one line for the table in docs/implementations.md.
  platforms: where it runs natively (a kernel backend elsewhere runs in the Pallas interpreter).
  pallas: a Pallas kernel backend, one that implementation="pallas" may resolve to.
  automatic: None and "pallas" may pick it (the ground truth "reference" is only named).
  device_rule: the GPUs it serves, in words (`serves` in code).
  """

  name: ClassVar[str] = ""
  summary: ClassVar[str] = ""
  platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
  pallas: ClassVar[bool] = False
  automatic: ClassVar[bool] = True
  device_rule: ClassVar[str] = "any GPU the Pallas kernels support"

  def serves(self, capability: tuple[int, int]) -> bool:
    """Whether it runs on a GPU of this compute capability."""
    return True

  def unsupported(self, problem: Any, *, named: bool) -> str | None:
    """Why it cannot take the call `problem` describes (a sentence naming the argument), or
    None. named: the caller named this implementation (else None or "pallas" picked it)."""
    return None

  def __call__(self, *args, **kwargs):
    raise NotImplementedError(f"{type(self).__name__} does not define __call__")

  def replace(self, **changes) -> Self:
    """A copy with the given config fields changed."""
    return dataclasses.replace(self, **changes)
