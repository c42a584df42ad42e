"""The Triton kernels: forward/ (the chunked operator's forward), backward/ (its backward),
inference/ (the recurrent step and grouped-query decode). Arrays in, arrays out
(docs/kernels.md)."""
