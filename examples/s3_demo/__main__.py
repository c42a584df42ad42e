"""`python -m examples.s3_demo` (from the repository root): the same as `python -m gdp_jax demo`."""

import argparse
import sys

from examples.s3_demo import demo

if __name__ == "__main__":
  parser = argparse.ArgumentParser(
    prog="python -m examples.s3_demo", description=demo.__doc__.split("\n\n")[0]
  )
  demo.add_arguments(parser)
  sys.exit(demo.run(parser.parse_args()))
