"""The layers' and HybridLM's partitioning annotations on one device
(docs/sharding.md#annotated-parameters): every parameter names one logical axis (or None) per
dimension, the rules put the head dimensions on "model", and without a mesh the model is created
as before. The sharded training step itself runs on 8 simulated devices in
tests/model_partitioning_checks.py."""

from __future__ import annotations

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from gdp_jax.layers import LOGICAL_AXIS_RULES
from gdp_jax.layers.delta_common import head_major as _head_major
from gdp_jax.layers.delta_common import writes_first as _writes_first
from gdp_jax.layers.partitioning import partitioned
from gdp_jax.models import HybridConfig, HybridLM

CONFIG = HybridConfig(
  vocab_size=16,
  hidden_size=32,
  layer_pattern="DHA",
  num_heads=4,
  head_dim=8,
  mask_mode="token",
  attn_num_heads=4,
  attn_num_kv_heads=2,
  mlp_ratio=2,
  chunk_size=16,
  implementation="xla",
)


def flat_params(model):
  return {path: v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_every_parameter_is_annotated_and_created_unsharded_without_a_mesh():
  params = flat_params(HybridLM(CONFIG, rngs=nnx.Rngs(0)))
  for path, v in params.items():
    names = v.get_metadata().get("out_sharding")
    assert names is not None and len(names) == v.get_value().ndim, (path, names)
    assert len(v.get_value().sharding.device_set) == 1, path  # metadata only
  assert len(params) >= 40


def test_rules_split_the_head_dimensions_over_model():
  model = HybridLM(CONFIG, rngs=nnx.Rngs(0))
  with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
    specs = {
      path: s.get_value()
      for path, s in nnx.to_flat_state(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    }
  mixer = lambda i, *rest: specs[("blocks", i, "mixer", *rest)]
  for i in range(3):  # block mask, DeltaProduct, attention
    assert mixer(i, "q_proj", "kernel") == P(None, "model")
    assert mixer(i, "o_proj", "kernel") == P("model", None)
  for i in range(2):
    assert mixer(i, "A_log") == P("model") and mixer(i, "g_proj", "kernel") == P(None, "model")
    assert mixer(i, "conv", "weight") == P(None, None)
  assert mixer(0, "k_proj", "kernel") == P(None, "model")
  assert mixer(0, "mask_proj", "bias") == P("model")
  # DeltaProduct's k, v, b columns are [n_h, H, ...]: no contiguous split is one of heads
  assert mixer(1, "k_proj", "kernel") == P(None, None)
  assert mixer(2, "k_proj", "kernel") == P(None, "model")  # kv_heads
  assert specs[("blocks", 0, "mlp", "up", "kernel")] == P(None, "model")
  assert specs[("embed", "embedding")] == P(None, None)


def test_head_major_columns_and_back():
  """`_head_major` puts each head's writes side by side; `_writes_first` undoes it."""
  n, heads, width = 3, 4, 2
  a = np.arange(5 * n * heads * width, dtype=np.float32).reshape(5, -1)
  hm = np.asarray(_head_major(a, n, heads, width))
  want = a.reshape(5, n, heads, width).transpose(0, 2, 1, 3).reshape(5, -1)
  np.testing.assert_array_equal(hm, want)
  back = np.asarray(_writes_first(hm, n, heads, width))
  np.testing.assert_array_equal(back, a.reshape(5, n, heads, width))
  np.testing.assert_array_equal(np.asarray(_head_major(a, 1, heads, width)), a)


def test_annotated_initializers_draw_what_the_plain_ones_draw():
  """Same keys, shapes and dtypes: a model's values do not depend on its annotations."""
  init = nnx.initializers.lecun_normal()
  annotated = nnx.Linear(
    32, 8, use_bias=False, kernel_init=partitioned(init, ("embed", "heads")), rngs=nnx.Rngs(3)
  )
  plain = nnx.Linear(32, 8, use_bias=False, kernel_init=init, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(annotated.kernel.get_value(), plain.kernel.get_value())
  assert annotated.kernel.get_metadata()["out_sharding"] == ("embed", "heads")
