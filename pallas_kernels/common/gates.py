"""The reset of the state by the log-decay g, one constant for every implementation.

A log-decay at or below RESET_LOG_DECAY is a reset of the state (docs/chunked_form.md#resets):
exp(-112) is below the smallest float32 subnormal (1.4e-45, reached from g < -103.3), so it is
exactly 0 whether or not the hardware flushes subnormals to zero (at -88, exp(g) is a subnormal
that only a flush makes 0). The operator clamps g at it before any implementation runs (g = -inf
would make the chunked forms' -inf - (-inf) = nan), the jnp chunked form treats g <= it as an
exact reset, and the layers write it at a document start.
"""

RESET_LOG_DECAY = -112.0
