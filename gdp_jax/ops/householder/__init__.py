"""The Householder form of the gated delta product (DeltaProduct, docs/operator.md): api.py
(the public functions, built on the r = 1 operator over n_h sub-steps per token) and
reference.py."""
