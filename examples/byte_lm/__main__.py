"""`python -m examples.byte_lm` (from the repository root): train a byte-level hybrid LM
(examples/byte_lm/train_lm.py; docs/train_lm.md)."""

import argparse
import sys

from examples import missing_extra

PROG = "python -m examples.byte_lm"


def main(argv=None) -> int:
  """The command line: 0, or 2 after a one-line message for a bad option or a missing extra
  (argparse's way)."""
  message = missing_extra(PROG)
  if message:
    print(message, file=sys.stderr)
    return 2
  from examples.byte_lm import train_lm
  from gdp_jax import compilation_cache

  parser = argparse.ArgumentParser(
    prog=PROG,
    description=train_lm.__doc__.split("\n\n")[0],
    epilog="presets, corpus and FLOP count: docs/train_lm.md",
  )
  train_lm.add_arguments(parser)
  args = parser.parse_args(argv)
  if argv is None:  # the command line; callers passing argv (tests) keep their own cache
    compilation_cache.enable(args.compilation_cache)  # docs/train_lm.md#compile-time
  return train_lm.run(args)


if __name__ == "__main__":
  sys.exit(main())
