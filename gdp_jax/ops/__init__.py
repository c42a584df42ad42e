"""The ops, one folder each (docs/implementations.md#layout): gated_delta_product, householder,
step (the recurrent one-token step) and gqa_decode (dense and paged).

Each folder holds the public function and its argument checks (`api.py`), its reference, its jnp
implementation (`xla.py`) and one module per kernel backend (`triton.py`); `dispatch.py` maps
implementation names to their instances; `validation.py` and `heads.py` are shared below the APIs.
The public functions are imported from `gdp_jax` itself.
"""
