"""Grouped-query attention decode over a dense or a paged KV cache (docs/inference.md)."""
