"""The recurrent step: one token of the gated delta product (docs/inference.md)."""
