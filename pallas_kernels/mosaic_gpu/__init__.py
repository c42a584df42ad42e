"""Pallas Mosaic GPU kernels (Hopper, sm_90) of the chunked gated delta product
(docs/mosaic_gpu.md).

Arrays in, arrays out: no autodiff, no layers, nothing from `gdp_jax`. The forward:
`chunk_inverse` (T0 per chunk, its 16-row groups solved by `diag_solve`) and `walk_ws` (the
warp-specialised state walk and output), prepared and run by `forward`. The backward:
`backward_walk` (the reverse state walk) and `chunk_grads` (every input gradient per chunk).
`ring` is the walks' TMA ring, `common` the helpers they share.
"""
