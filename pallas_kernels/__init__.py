"""Pallas GPU kernels (Triton lowering) of the chunked gated delta product.

Arrays in, arrays out: no autodiff, no layers. `pallas_kernels.common.backend` decides
interpret mode and compiler parameters in one place (docs/pallas_triton.md). The kernel
pipeline is described in docs/kernels.md, the layout in docs/implementations.md#layout.
"""
