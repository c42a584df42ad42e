"""Examples built on gdp-jax, kept outside the package (as flax keeps `examples/lm1b`): the S3
word-problem demo (`examples/s3_demo`) and the byte-level language model (`examples/byte_lm`).
They need the `examples` extra: `pip install -e ".[examples]"`."""
