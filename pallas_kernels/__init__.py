"""Pallas GPU kernels (Triton lowering) of the chunked gated delta product.

Arrays in, arrays out: no autodiff, no layers. `pallas_kernels.common.backend` decides interpret mode and
compiler parameters in one place (DESIGN §4, §8).
"""
