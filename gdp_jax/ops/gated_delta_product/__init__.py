"""The chunked operator `gated_delta_product` (docs/operator.md): api.py (the public function),
reference.py, xla.py (+ xla_backward.py), triton.py, mosaic_gpu.py (Hopper); nonfinite.py and
varlen.py are what the implementations share (non-finite inputs, packed sequences)."""
