"""Qwen3.5 checkpoints in transformers' format to and from `Qwen3_5LM` (docs/qwen3_5.md#loading).

    model = load("path/to/folder", dtype=jnp.bfloat16)   # config.json + *.safetensors
    save(model, "path/to/out")                           # loads in transformers again

Weights are read with the `safetensors` package's NumPy API (no torch), one tensor at a time,
from model.safetensors or the shards model.safetensors.index.json lists. Text-only
(Qwen3_5ForCausalLM: "model.layers...") and multimodal checkpoints ("model.language_model.
layers...") load; the vision tower and the multi-token-prediction head are skipped. Each
transformers weight maps to our parameters by `weight_map` (mostly a transpose; in_proj_qkv
splits into the q, k, v projections, conv1d [C, 1, W] is our [W, C]). `save` writes the text
model (Qwen3_5ForCausalLM's names and config.json).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.qwen3_5.config import Qwen3_5Config
from gdp_jax.qwen3_5.model import Qwen3_5LM

SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Weight(NamedTuple):
  """One transformers weight: its shape, and how to read it from / write it into our model
  (arrays in transformers' layout)."""

  shape: tuple[int, ...]
  read: Callable[[], np.ndarray]
  write: Callable[[np.ndarray], None]


def _plain(var: nnx.Variable, transpose: bool) -> tuple[Callable, Callable]:
  def read():
    value = np.asarray(var[...])
    return value.T if transpose else value

  def write(value):
    var.set_value(jnp.asarray(value.T if transpose else value, var.get_value().dtype))

  return read, write


def _split_columns(vars_: list[nnx.Variable]) -> tuple[Callable, Callable]:
  """Our kernels [D, n_i] side by side are transformers' one [sum n_i, D] weight."""
  widths = [v.get_value().shape[1] for v in vars_]

  def read():
    return np.concatenate([np.asarray(v[...]) for v in vars_], axis=1).T

  def write(value):
    for v, part in zip(vars_, np.split(value.T, np.cumsum(widths)[:-1], axis=1)):
      v.set_value(jnp.asarray(part, v.get_value().dtype))

  return read, write


def _conv(var: nnx.Variable) -> tuple[Callable, Callable]:
  """Our depthwise kernel [W, C] is torch's Conv1d weight [C, 1, W]."""

  def read():
    return np.asarray(var[...]).T[:, None, :]

  def write(value):
    var.set_value(jnp.asarray(value[:, 0, :].T, var.get_value().dtype))

  return read, write


def _add(table, name, var, transpose=False, pair=None, shape=None):
  read, write = pair if pair is not None else _plain(var, transpose)
  if shape is None:
    shape = var.get_value().shape[::-1] if transpose else var.get_value().shape
  table[name] = Weight(tuple(shape), read, write)


def weight_map(model: Qwen3_5LM) -> dict[str, Weight]:
  """transformers' weight names (Qwen3_5ForCausalLM) -> `Weight` of our model."""
  table: dict[str, Weight] = {}
  _add(table, "model.embed_tokens.weight", model.embed_tokens.embedding)
  _add(table, "model.norm.weight", model.norm.weight)
  if not model.config.tie_word_embeddings:
    _add(table, "lm_head.weight", model.lm_head.kernel, transpose=True)
  for i, layer in enumerate(model.layers):
    p = f"model.layers.{i}."
    _add(table, p + "input_layernorm.weight", layer.input_layernorm.weight)
    _add(table, p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
      _add(table, f"{p}mlp.{name}.weight", getattr(layer.mlp, name).kernel, transpose=True)
    if layer.layer_type == "full_attention":
      attn = layer.self_attn
      for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        _add(table, f"{p}self_attn.{name}.weight", getattr(attn, name).kernel, transpose=True)
      _add(table, p + "self_attn.q_norm.weight", attn.q_norm.weight)
      _add(table, p + "self_attn.k_norm.weight", attn.k_norm.weight)
      continue
    gdn, q = layer.linear_attn, p + "linear_attn."
    qkv = [gdn.q_proj.kernel, gdn.k_proj.kernel, gdn.v_proj.kernel]
    width = sum(v.get_value().shape[1] for v in qkv)
    shape = (width, model.config.hidden_size)
    _add(table, q + "in_proj_qkv.weight", None, pair=_split_columns(qkv), shape=shape)
    _add(table, q + "in_proj_z.weight", gdn.g_proj.kernel, transpose=True)
    _add(table, q + "in_proj_b.weight", gdn.b_proj.kernel, transpose=True)
    _add(table, q + "in_proj_a.weight", gdn.a_proj.kernel, transpose=True)
    size, channels = gdn.conv.weight.get_value().shape
    _add(table, q + "conv1d.weight", None, pair=_conv(gdn.conv.weight), shape=(channels, 1, size))
    _add(table, q + "A_log", gdn.A_log)
    _add(table, q + "dt_bias", gdn.dt_bias)
    _add(table, q + "norm.weight", gdn.o_norm.weight)
    _add(table, q + "out_proj.weight", gdn.o_proj.kernel, transpose=True)
  return table


def _weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
  index = folder / "model.safetensors.index.json"
  if index.exists():
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [folder / s for s in shards]
  single = folder / "model.safetensors"
  if single.exists():
    return [single]
  found = sorted(folder.glob("*.safetensors"))
  if not found:
    raise FileNotFoundError(f"no *.safetensors weights in {folder}")
  return found


def _our_name(name: str, multimodal: bool) -> str | None:
  """A checkpoint's weight name as `weight_map` spells it, None for skipped weights."""
  if multimodal and name.startswith("model.language_model."):
    return "model." + name[len("model.language_model.") :]
  if name.startswith(SKIPPED_PREFIXES):
    return None
  return name


def load(
  folder: str | pathlib.Path, dtype: Any = jnp.float32, **config_overrides: Any
) -> Qwen3_5LM:
  """A `Qwen3_5LM` from a transformers checkpoint folder (config.json + safetensors).

  Args:
    folder: the checkpoint folder.
    dtype: the parameters' (and so the compute) dtype, jnp.float32 or jnp.bfloat16 (the
      checkpoint's values are cast).
    config_overrides: `Qwen3_5Config` fields, e.g. implementation="xla", chunk_size=32.

  A weight whose shape does not fit the config is a ValueError naming it, its shape and the
  one expected; a missing weight, or one the model has no place for, a KeyError naming it.
  """
  import safetensors

  folder = pathlib.Path(folder)
  dtype = DTYPES.get(str(dtype), dtype)
  if not any(dtype == d for d in DTYPES.values()):
    raise TypeError(f"dtype must be float32 or bfloat16, got {dtype!r}")
  config = Qwen3_5Config.from_dict(
    json.loads((folder / "config.json").read_text()), **config_overrides
  )
  # abstract parameters (no random initialisation to run), each replaced by the checkpoint's
  model = nnx.eval_shape(lambda: Qwen3_5LM(config, param_dtype=dtype, rngs=nnx.Rngs(0)))
  table = weight_map(model)
  seen = set()
  for path in _weight_files(folder):
    with safetensors.safe_open(str(path), framework="numpy") as f:
      names = list(f.keys())
      multimodal = any(n.startswith("model.language_model.") for n in names)
      for name in names:
        ours = _our_name(name, multimodal)
        if ours is None or (ours == "lm_head.weight" and config.tie_word_embeddings):
          continue  # skipped, or the tied head's copy of the embedding
        if ours not in table:
          raise KeyError(
            f"weight {name!r} in {path.name} has no place in a Qwen3.5 text model of this "
            f"config ({config.num_hidden_layers} layers, tie_word_embeddings = "
            f"{config.tie_word_embeddings})"
          )
        value = f.get_tensor(name)
        expected = table[ours].shape
        if tuple(value.shape) != expected:
          raise ValueError(
            f"weight {name!r} in {path.name} has shape {tuple(value.shape)}, expected "
            f"{expected} for the config in {folder / 'config.json'}"
          )
        table[ours].write(np.asarray(value))  # cast once, to the parameter's dtype
        seen.add(ours)
  missing = [n for n in table if n not in seen]
  if missing:
    raise KeyError(f"weight {missing[0]!r} is missing from {folder} ({len(missing)} missing)")
  return model


def save(model: Qwen3_5LM, folder: str | pathlib.Path, dtype: Any = None) -> pathlib.Path:
  """Write `model` as transformers' Qwen3_5ForCausalLM checkpoint: config.json and
  model.safetensors (in `dtype`, default the parameters' dtype: float32 or bfloat16)."""
  import ml_dtypes
  import safetensors.numpy

  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  if dtype is None:
    dtype = model.norm.weight[...].dtype
  name = jnp.dtype(dtype).name
  if name not in DTYPES:
    raise TypeError(f"dtype must be float32 or bfloat16, got {dtype!r}")
  np_dtype = np.float32 if name == "float32" else ml_dtypes.bfloat16
  tensors = {
    n: np.ascontiguousarray(np.asarray(w.read(), np.float32).astype(np_dtype))
    for n, w in weight_map(model).items()
  }
  safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  config = dict(model.config.to_dict(), dtype=name)
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return folder
