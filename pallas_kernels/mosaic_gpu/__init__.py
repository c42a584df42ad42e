"""Pallas Mosaic GPU kernels (Hopper, sm_90) of the chunked gated delta product forward.

Arrays in, arrays out: no autodiff, no layers, nothing from `gdp_jax`. Two kernels
(docs/chunked_form.md has the math):

- `chunk_inverse.chunk_inverse`: per chunk, the gate-free T0 = (I + A0)^-1 in bf16/fp16;
- `walk_ws.state_walk_ws`: per (batch, head, value tile), the float32 state walk and the output,
  warp-specialised, applying the gates to T0 inside the walk;

`forward.forward` prepares the inputs (padding, gamma, mask rows) and runs both.
"""
