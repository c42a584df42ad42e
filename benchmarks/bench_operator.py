"""Time `gated_delta_product` forward and forward + backward, side by side with peers.

  python benchmarks/bench_operator.py --out results.json            # the H200 shapes
  python benchmarks/bench_operator.py --tiny --out /tmp/tiny.json   # a smoke run on CPU

A thin caller of `benchmarks.bench` (`python -m benchmarks.bench`, with `--out` required):
flags --out --shape --rs --dtype --modes --impls --reps --inner --tiny, plus --plot, --no-plot,
--reference-max-gb, --no-progress. Implementations: ours ("pallas", "xla", "reference"), and when
importable, flash-linear-attention 0.6.0's `chunk_gated_delta_rule` ("fla") and
jax-linear-attention's Gated DeltaNet ("jla"). Each figure is the median over repeated timed runs
after warm-up; a case that fails records its error and the run goes on. See `benchmarks/bench.py`
for what the TFLOP/s and GB/s figures count.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import bench  # noqa: E402


def main(argv=None):
  return bench.main(argv, prog="bench_operator.py", out_required=True)


if __name__ == "__main__":
  sys.exit(main())
