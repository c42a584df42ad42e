"""`gdp_jax.dispatch` is gdp_jax/ops/dispatch.py (the same module object, so that a setting
changed on either name holds for both)."""

import sys

from gdp_jax.ops import dispatch as _dispatch
from gdp_jax.ops.dispatch import *  # noqa: F403 (the names, for type checkers)

sys.modules[__name__] = _dispatch
