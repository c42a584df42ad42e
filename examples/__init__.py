"""Examples built on gdp-jax, kept outside the package (as flax keeps `examples/lm1b`): the S3
word-problem demo (`python -m examples.s3_demo`, `make demo`) and the byte-level language model
(`python -m examples.byte_lm`, docs/train_lm.md). Run them from the repository root; they need
the `examples` extra: `pip install -e ".[examples]"`."""

import importlib.util

# What the `examples` extra brings that the examples import (matplotlib stays optional: the plots
# are skipped with a message without it).
EXTRA_PACKAGES = ("optax", "orbax.checkpoint", "tqdm")


def missing_extra(command: str) -> str | None:
  """A one-line message naming the first package of the `examples` extra that is not
  installed, or None when all are."""
  for package in EXTRA_PACKAGES:
    try:
      found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
      found = False
    if not found:
      return f'{command} needs {package!r}, from the `examples` extra: pip install -e ".[examples]"'
  return None
