"""The byte-level hybrid language model trained on Python source (`examples/byte_lm/train_lm.py`;
docs/train_lm.md)."""
