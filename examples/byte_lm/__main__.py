"""`python -m examples.byte_lm` (from the repository root): the same as `python -m gdp_jax
train-lm`."""

import argparse
import sys

from examples.byte_lm import train_lm
from gdp_jax import compilation_cache

if __name__ == "__main__":
  parser = argparse.ArgumentParser(
    prog="python -m examples.byte_lm",
    description=train_lm.__doc__.split("\n\n")[0],
    epilog="presets, corpus and FLOP count: docs/train_lm.md",
  )
  train_lm.add_arguments(parser)
  args = parser.parse_args()
  compilation_cache.enable(args.compilation_cache)  # docs/train_lm.md#compile-time
  sys.exit(train_lm.run(args))
