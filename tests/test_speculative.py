"""examples/speculative.py: greedy speculative decoding gives plain greedy decoding's tokens with
fewer target calls (docs/inference.md#verifying-draft-tokens)."""

from __future__ import annotations

import pytest

from examples import speculative


@pytest.mark.slow  # compiles two models' prefill, step and step_tokens programs and generate's
def test_speculative_equals_greedy_with_fewer_target_calls():
  result = speculative.main(["--new-tokens", "16", "--draft-tokens", "4"])
  assert result["equal_to_greedy"], result
  assert result["target_calls"] < result["plain_greedy_target_calls"], result
  # a round that rejects a draft rolls back; one that accepts all does not
  assert result["target_verify"] + 1 == result["target_calls"] - result["target_rollback"]
