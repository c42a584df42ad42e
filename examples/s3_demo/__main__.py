"""`python -m examples.s3_demo` (from the repository root; `make demo`): the main job, small
models trained on the S3 word problem, then generation (examples/s3_demo/demo.py)."""

import argparse
import sys

from examples import missing_extra

PROG = "python -m examples.s3_demo"


def main(argv=None) -> int:
  """The command line: the demo's status, or 2 after a one-line message for a missing extra."""
  message = missing_extra(PROG)
  if message:
    print(message, file=sys.stderr)
    return 2
  from examples.s3_demo import demo

  parser = argparse.ArgumentParser(prog=PROG, description=demo.__doc__.split("\n\n")[0])
  demo.add_arguments(parser)
  return demo.run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
