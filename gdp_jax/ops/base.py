"""What an implementation of an op is: a frozen dataclass whose fields are its config.

After tokamax's `Op`: the object is hashable (its config can be a static argument of `jax.jit` and
of `jax.custom_vjp`), `replace` returns a copy with other config, and the dispatch table
(gdp_jax/ops/dispatch.py) maps each implementation name to an instance with the default config
(docs/implementations.md#registering-an-implementation).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Self


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One backend of one op. Subclasses set the class attributes and add their config as fields.

  name: the implementation's name in the dispatch table ("reference", "xla", "triton", ...).
  summary: one line for the table in docs/implementations.md.
  platforms: where it runs natively (a kernel backend elsewhere runs in the Pallas interpreter).
  pallas: a Pallas kernel backend, one that implementation="pallas" may resolve to.
  """

  name: ClassVar[str] = ""
  summary: ClassVar[str] = ""
  platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
  pallas: ClassVar[bool] = False

  def __call__(self, *args, **kwargs):
    raise NotImplementedError(f"{type(self).__name__} does not define __call__")

  def replace(self, **changes) -> Self:
    """A copy with the given config fields changed."""
    return dataclasses.replace(self, **changes)
