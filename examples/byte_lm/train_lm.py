"""`python -m examples.byte_lm` (from the repository root): a byte-level hybrid language model
trained on the Python standard library's source, with learning curves, tokens per second and
MFU.

    python -m examples.byte_lm --preset tiny --out runs/tiny            # a CPU, 1-2 minutes
    python -m examples.byte_lm --preset h200 --model gdp-r2 --out runs/r2 --minutes 3
    python -m examples.byte_lm --compare runs/*/metrics.json --out runs  # curves side by side

From Python: `metrics = train_lm(preset_config("tiny", out="runs/tiny"))`.

The corpus (every machine with Python has it, no download): the `.py` files under the running
interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), read as raw bytes, found
by a sorted walk that skips `site-packages`, `dist-packages` and `__pycache__` folders, symbolic
links, empty files and files over 512 KiB (generated data: `pydoc_data/topics.py`). The
standard library's own tests are kept (they are real Python). A file is in the validation split
when the first 8 bytes of sha256(its path relative to the root, '/'-separated) read as a
big-endian integer are < val_percent % of 2^64: the same files on every machine with the same
Python version, whatever the root path and the walk order.

Tokens and packing: bytes 0..255, BOS = 256 before every document, PAD = 257 after a document
up to the next multiple of 64 tokens, so each document starts at a multiple of 64 (every
chunk size divides it; see below). The training documents, in an order shuffled once with a
fixed seed, are concatenated into one stream; a training batch takes B windows of T + 1 tokens
at random offsets (multiples of 64) drawn from a generator seeded by (seed, step), so a resumed
run sees the same batches. Validation is a fixed set of `eval_batches * batch_size` windows
spread evenly over the validation stream (`val_batches`). The loss
counts the targets that are bytes (not BOS, not PAD): every byte of a document is predicted
from its own document's BOS and earlier bytes only. Bits per byte = mean nats / ln 2.

Documents do not see each other: segment ids (one per document, PADs belong to the document
before them) go to every layer (`HybridLM(tokens, segment_ids=...)`): attention is masked by
segment, the short convolution reads zeros across a boundary, and the gated delta product state
is reset at each BOS through the log-decay g = -112 (exp(g) = 0 in float32). The operator's
packed form (cu_seqlens, docs/varlen.md) needs one row with a static number of documents, which
these batches of B random windows do not have; with documents starting at chunk boundaries the
reset is exact in the gradient too (docs/train_lm.md).

Training: AdamW (weight decay on matrices only), linear warm-up then cosine decay to
`min_lr_ratio` of the peak, global-norm gradient clipping, bfloat16 compute with float32
parameters, orbax checkpoints (`--resume` continues the latest readable one; what it found, and
an interrupted save, in docs/train_lm.md#checkpoints), a progress bar with loss and
tokens/s, validation bits per byte, and `metrics.json` + `curves.png` in `--out`.

FLOPs per token (`flops_per_token`, written out in docs/train_lm.md): matmuls of the projections,
MLP and vocabulary head, causal attention (the average of (T + 1) / 2 keys per query) and the
operator's chunked form (`benchmarks.bench.forward_flops`), times 3 for forward + backward.
MFU = FLOPs per token x tokens per second / (--peak-tflops x 1e12), on a GPU; n/a elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from typing import Any, NamedTuple

import numpy as np

from gdp_jax.ops.gated_delta_product.api import IMPLEMENTATIONS

SCHEMA = "gdp_jax.train_lm/1"
BOS, PAD = 256, 257
VOCAB_SIZE = 258
ALIGN = 64  # documents start at multiples of this (all chunk sizes divide it)
MAX_FILE_BYTES = 512 * 1024
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
SHUFFLE_SEED = 1234  # the training documents' order (fixed: not the run's seed)

# --model: how each choice builds the token mixers. "attention" replaces every layer of the
# pattern by attention; the others keep the pattern's "D" layers as GatedDeltaProduct with
# these settings. "dp-2" is the Householder DeltaProduct (2 rank-1 delta steps per token,
# eigenvalues in [-1, 1]; docs/operator.md).
MODELS: dict[str, dict[str, Any]] = {
  "attention": dict(attention_only=True, mask_mode="ones", num_blocks=1),
  "gdn": dict(attention_only=False, mask_mode="ones", num_blocks=1),  # Gated DeltaNet
  "gdp-r2": dict(attention_only=False, mask_mode="static", num_blocks=2),
  "gdp-r4": dict(attention_only=False, mask_mode="static", num_blocks=4),
  "dp-2": dict(
    attention_only=False,
    mask_mode="householder",
    num_blocks=1,
    num_householder=2,
    allow_neg_eigval=True,
  ),
}


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


class TrainLMError(ValueError):
  """A bad option, corpus or checkpoint, in one line: the command line prints it as
  `python -m examples.byte_lm: error: <message>` and exits with status 2 (argparse's convention)."""


@dataclasses.dataclass
class TrainConfig:
  """Everything a run depends on (`preset_config` fills it from a preset).

  Model: hidden_size, layers (pattern of "D" gated delta product / "A" attention letters; the
  "attention" model uses "A" for all), num_heads, head_dim (K; V = K), attn_num_heads,
  attn_num_kv_heads, attn_head_dim, mlp_ratio, chunk_size, use_short_conv, dtype ("bf16": bf16
  compute, float32 parameters; "f32"), implementation (operator: None = Pallas on a supported
  GPU, xla elsewhere), attn_impl ("auto" = "flash" on a GPU, "xla" elsewhere), scan_layers
  (`HybridConfig.scan_layers`; default unrolled, docs/train_lm.md#compile-time).
  Run: steps (the schedule's length) or minutes (steps set from the timed step), stop_at (stop
  after this step, checkpointed, to continue with resume), batch_size, seq_len (a multiple of
  64), lr (peak), min_lr_ratio, warmup_steps, weight_decay, b1, b2, clip_norm, eval_every,
  eval_batches, log_every, ckpt_every (0: only at the end; checkpoint=False: never), seed.
  """

  preset: str = "tiny"
  model: str = "gdp-r2"
  out: str | None = None
  steps: int = 60
  minutes: float | None = None
  stop_at: int | None = None
  resume: bool = False
  batch_size: int = 8
  seq_len: int = 128
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 10
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  eval_every: int = 20
  eval_batches: int = 2
  log_every: int = 1
  checkpoint: bool = True
  ckpt_every: int = 0
  seed: int = 0
  hidden_size: int = 64
  layers: str = "DA"
  num_heads: int = 2
  head_dim: int = 32
  attn_num_heads: int = 2
  attn_num_kv_heads: int = 1
  attn_head_dim: int | None = None
  mlp_ratio: int = 2
  chunk_size: int = 16
  use_short_conv: bool = True
  dtype: str = "bf16"
  implementation: str | None = None
  attn_impl: str = "auto"
  scan_layers: bool | None = False
  peak_tflops: float = 989.0
  corpus_dir: str | None = None
  val_percent: float = 2.0
  progress: bool | None = None  # False: no progress bar (tqdm) on stderr
  plot: bool = True

  def validate(self):
    if self.model not in MODELS:
      raise TrainLMError(f"model must be one of {tuple(MODELS)}, got {self.model!r}")
    if self.dtype not in ("bf16", "f32"):
      raise TrainLMError(f"dtype must be 'bf16' or 'f32', got {self.dtype!r}")
    if self.attn_impl not in ("auto", "xla", "flash"):
      raise TrainLMError(f"attn_impl must be 'auto', 'xla' or 'flash', got {self.attn_impl!r}")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainLMError(f"{name} must be a positive integer, got {value!r}")
    if self.seq_len % ALIGN:
      raise TrainLMError(
        f"seq_len must be a multiple of {ALIGN} (documents start at multiples "
        f"of {ALIGN} tokens), got {self.seq_len}"
      )
    for name in ("ckpt_every", "warmup_steps", "seed"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TrainLMError(f"{name} must be a non-negative integer, got {value!r}")
    for name in ("lr", "peak_tflops"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise TrainLMError(f"{name} must be a positive number, got {value!r}")
    if self.minutes is not None and not self.minutes > 0:
      raise TrainLMError(f"minutes must be > 0, got {self.minutes!r}")
    if self.stop_at is not None and self.stop_at < 1:
      raise TrainLMError(f"stop_at must be >= 1, got {self.stop_at!r}")
    if not 0 < self.val_percent < 100:
      raise TrainLMError(f"val_percent must lie in (0, 100), got {self.val_percent!r}")
    if (self.resume or self.stop_at) and not (self.out and self.checkpoint):
      raise TrainLMError("resume and stop_at need an out folder and checkpoints")


PRESETS: dict[str, dict[str, Any]] = {
  # About a minute on a 2-core CPU (most of it compilation): learning curve, not a model.
  "tiny": dict(
    steps=60,
    batch_size=8,
    seq_len=128,
    lr=3e-3,
    warmup_steps=10,
    eval_every=20,
    eval_batches=2,
    log_every=1,
    hidden_size=64,
    layers="DA",
    num_heads=2,
    head_dim=32,
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
    chunk_size=16,
  ),
  # About 117M parameters (gdp models; 104M attention only), 32K tokens per step: a few
  # minutes on one H200.
  "h200": dict(
    steps=1500,
    batch_size=8,
    seq_len=4096,
    lr=1e-3,
    warmup_steps=100,
    eval_every=100,
    eval_batches=4,
    log_every=10,
    ckpt_every=500,
    hidden_size=768,
    layers="DDDA" * 3,
    num_heads=6,
    head_dim=128,
    attn_num_heads=12,
    attn_num_kv_heads=4,
    attn_head_dim=64,
    mlp_ratio=4,
    chunk_size=64,
  ),
}


def preset_config(preset: str = "tiny", **overrides) -> TrainConfig:
  """A TrainConfig from a preset ("tiny" or "h200") with fields overridden."""
  if preset not in PRESETS:
    raise TrainLMError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
  fields = dict(PRESETS[preset], preset=preset)
  fields.update({k: v for k, v in overrides.items()})
  return TrainConfig(**fields)


def model_config(cfg: TrainConfig):
  """The HybridConfig of a run (a TrainLMError if the model's own checks refuse it)."""
  import jax
  from flax import nnx

  from gdp_jax.models import HybridLM

  spec = MODELS[cfg.model]
  layers = "A" * len(cfg.layers) if spec["attention_only"] else cfg.layers
  attn_impl = cfg.attn_impl
  if attn_impl == "auto":
    attn_impl = "flash" if jax.default_backend() == "gpu" else "xla"
  try:
    mc = _hybrid_config(cfg, spec, layers, attn_impl)
    # the layers' own checks (a width the heads do not divide), traced only: nothing computed
    nnx.eval_shape(lambda: HybridLM(mc, rngs=nnx.Rngs(0)))
  except ValueError as e:  # the model's own checks (widths, heads, layer pattern)
    raise TrainLMError(f"model settings: {e}") from None
  return mc


def _hybrid_config(cfg, spec, layers, attn_impl):
  import jax.numpy as jnp

  from gdp_jax.models import HybridConfig

  return HybridConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=cfg.hidden_size,
    layer_pattern=layers,
    num_heads=cfg.num_heads,
    head_dim=cfg.head_dim,
    num_blocks=spec["num_blocks"],
    mask_mode=spec["mask_mode"],
    num_householder=spec.get("num_householder", 2),
    allow_neg_eigval=spec.get("allow_neg_eigval", False),
    use_short_conv=cfg.use_short_conv,
    chunk_size=cfg.chunk_size,
    attn_num_heads=cfg.attn_num_heads,
    attn_num_kv_heads=cfg.attn_num_kv_heads,
    attn_head_dim=cfg.attn_head_dim,
    attn_impl=attn_impl,
    mlp_ratio=cfg.mlp_ratio,
    implementation=cfg.implementation,
    dtype=jnp.bfloat16 if cfg.dtype == "bf16" else None,
    scan_layers=cfg.scan_layers,
  )


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def _percent(fraction: float | None, digits: int) -> str:
  """A fraction as a percentage, or "n/a" (MFU off a GPU)."""
  return "n/a" if fraction is None else f"{100 * fraction:.{digits}f}%"


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_validation(relpath: str, val_percent: float) -> bool:
  """The split rule: sha256 of the '/'-separated relative path, first 8 bytes big-endian, below
  val_percent % of 2^64."""
  head = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
  return head < val_percent / 100.0 * 2.0**64


def corpus_files(root: str | None = None):
  """Sorted [(relative '/'-path, absolute path)] of the corpus files under `root` (default the
  standard library), by the rules in the module docstring."""
  root = os.path.abspath(root or stdlib_root())
  if not os.path.isdir(root):
    raise TrainLMError(f"corpus folder {root!r} does not exist (--corpus-dir)")
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(
      d for d in dirnames if d not in SKIP_DIRS and not os.path.islink(os.path.join(dirpath, d))
    )
    for name in sorted(filenames):
      path = os.path.join(dirpath, name)
      if not name.endswith(".py") or os.path.islink(path):
        continue
      size = os.path.getsize(path)
      if 0 < size <= MAX_FILE_BYTES:
        out.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
  return sorted(out)


class Corpus(NamedTuple):
  train: Stream
  val: Stream
  info: dict


class Stream(NamedTuple):
  """Packed documents: tokens [N] uint16 and doc [N] int32 (the document index of each token;
  PADs carry the index of the document before them). N is a multiple of ALIGN."""

  tokens: np.ndarray
  doc: np.ndarray


def pack(documents, align: int = ALIGN) -> Stream:
  """BOS + bytes + PADs up to a multiple of `align` per document, concatenated."""
  lengths = [-(-(len(d) + 1) // align) * align for d in documents]
  tokens = np.full(sum(lengths), PAD, np.uint16)
  doc = np.repeat(np.arange(len(documents), dtype=np.int32), lengths)
  pos = 0
  for d, n in zip(documents, lengths):
    tokens[pos] = BOS
    tokens[pos + 1 : pos + 1 + len(d)] = np.frombuffer(d, np.uint8)
    pos += n
  return Stream(tokens, doc)


@functools.lru_cache(maxsize=2)
def load_corpus(root: str | None = None, val_percent: float = 2.0) -> Corpus:
  """The corpus split into packed training and validation streams, with a summary (cached per
  root and val_percent for the process; the arrays are read-only)."""
  files = corpus_files(root)
  if not files:
    raise TrainLMError(f"no .py files found under {root or stdlib_root()!r} (--corpus-dir)")
  train: list[tuple[str, bytes]] = []
  val: list[tuple[str, bytes]] = []
  digest = hashlib.sha256()
  for rel, path in files:
    with open(path, "rb") as f:
      data = f.read()
    digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    (val if is_validation(rel, val_percent) else train).append((rel, data))
  if not train or not val:
    empty = "training" if not train else "validation"
    raise TrainLMError(
      f"the split of {len(files)} files left no {empty} files (val_percent = {val_percent})"
    )
  order = np.random.default_rng(SHUFFLE_SEED).permutation(len(train))
  train_stream = pack([train[i][1] for i in order])
  val_stream = pack([d for _, d in val])
  for a in (*train_stream, *val_stream):
    a.flags.writeable = False
  info = dict(
    # "stdlib": the running Python's standard library (no machine path in kept metrics).
    root="stdlib" if root is None else root,
    python=platform.python_version(),
    files=len(files),
    train_files=len(train),
    val_files=len(val),
    train_bytes=sum(len(d) for _, d in train),
    val_bytes=sum(len(d) for _, d in val),
    train_tokens=int(train_stream.tokens.size),
    val_tokens=int(val_stream.tokens.size),
    train_pad_tokens=int(np.sum(train_stream.tokens == PAD)),
    val_percent=val_percent,
    sha256=digest.hexdigest(),
    rules=(
      "*.py under the root, sorted walk; skipped: folders "
      + ", ".join(SKIP_DIRS)
      + f", symbolic links, empty files, files over {MAX_FILE_BYTES} bytes; "
      "validation: sha256(relative path)[:8] < val_percent % of 2^64; "
      f"BOS + bytes + PAD to a multiple of {ALIGN} per document"
    ),
    val_sample=[rel for rel, _ in val[:5]],
  )
  return Corpus(train_stream, val_stream, info)


def _windows(stream: Stream, offsets, seq_len):
  """inputs [B, T], targets [B, T] (the next tokens), segment ids [B, T], all int32."""
  idx = np.asarray(offsets)[:, None] + np.arange(seq_len + 1)[None, :]
  tokens = stream.tokens[idx].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:], stream.doc[idx[:, :-1]]


def train_batch(stream: Stream, step: int, seed: int, batch_size: int, seq_len: int):
  """The batch of `step`: B windows at offsets (multiples of ALIGN) drawn from a generator
  seeded by (seed, step)."""
  slots = (stream.tokens.size - seq_len - 1) // ALIGN + 1
  if slots < 1:
    raise TrainLMError(
      f"the training stream ({stream.tokens.size} tokens) is shorter than one "
      f"window of seq_len + 1 = {seq_len + 1}"
    )
  rng = np.random.default_rng([seed, step])
  return _windows(stream, rng.integers(0, slots, batch_size) * ALIGN, seq_len)


def val_batches(stream: Stream, batch_size: int, seq_len: int, n_batches: int):
  """The fixed validation set: n_batches * B windows spread evenly over the validation stream
  (offsets i * floor(slots / count) * ALIGN, slots = the window starts that fit), or every
  window start when fewer fit; in batches of at most B."""
  slots = (stream.tokens.size - seq_len - 1) // ALIGN + 1
  if slots < 1:
    raise TrainLMError(
      f"the validation stream ({stream.tokens.size} tokens) is shorter than "
      f"one window of seq_len + 1 = {seq_len + 1}"
    )
  count = min(n_batches * batch_size, slots)
  offsets = np.arange(count) * (slots // count) * ALIGN
  return [
    _windows(stream, offsets[i : i + batch_size], seq_len) for i in range(0, count, batch_size)
  ]


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------


def flops_per_token(mc, seq_len: int) -> dict:
  """Forward and training (3x forward) FLOPs per token of HybridLM(mc) at sequence seq_len,
  counting matmuls only (docs/train_lm.md): projections, MLP, head, attention, operator."""
  from benchmarks.bench import forward_flops

  D, T = mc.hidden_size, seq_len
  H, K = mc.num_heads, mc.head_dim
  V = int(K * mc.expand_v)
  r = 1 if mc.mask_mode == "ones" else mc.num_blocks
  hq, hkv = mc.attn_num_heads, mc.attn_num_kv_heads
  dh = mc.attn_head_dim or D // hq
  parts = dict(projections=0.0, operator=0.0, attention=0.0, mlp=0.0, head=2.0 * D * mc.vocab_size)
  for kind in mc.layer_pattern:
    householder = kind == "H" or (kind == "D" and mc.mask_mode == "householder")
    if householder:  # n_h keys, values and betas per token; the r = 1 operator over T*n_h steps
      n = mc.num_householder
      parts["projections"] += 2.0 * D * (H * K + n * (H * K + H * V + H) + H) + 2.0 * H * V * D
      if mc.use_gate:
        parts["projections"] += 2.0 * D * H * V
      parts["operator"] += forward_flops(1, T * n, H, K, V, 1) / T
    elif kind == "D":
      parts["projections"] += 2.0 * D * (2 * H * K + H * V + 2 * H) + 2.0 * H * V * D
      if mc.use_gate:
        parts["projections"] += 2.0 * D * H * V
      if mc.mask_mode == "token":
        parts["projections"] += 2.0 * D * H * r * r
      parts["operator"] += forward_flops(1, T, H, K, V, r) / T
    else:
      parts["projections"] += 2.0 * D * (hq * dh + 2 * hkv * dh) + 2.0 * hq * dh * D
      parts["attention"] += 2.0 * hq * dh * (T + 1)  # QK^T and PV over (T+1)/2 keys
    if mc.mlp_ratio:
      parts["mlp"] += 2.0 * 3 * D * mc.mlp_ratio * D
  forward = sum(parts.values())
  return dict(forward=forward, train=3.0 * forward, forward_parts=parts)


def count_params(params) -> int:
  import jax

  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------------------------
# Steps (module level and keyed by static hyperparameters, so runs in one process share the
# compilation)
# ----------------------------------------------------------------------------------------------


class Hyper(NamedTuple):
  """Optimiser settings. The schedule's four numbers travel into the jitted step as one traced
  array (`schedule_array`), so runs of other lengths reuse the compiled step."""

  lr: Any
  min_lr_ratio: Any
  warmup: Any
  steps: Any
  weight_decay: float
  b1: float
  b2: float
  clip_norm: float

  def schedule_array(self):
    return np.asarray([self.lr, self.min_lr_ratio, self.warmup, self.steps], np.float32)

  def static(self):
    return (self.weight_decay, self.b1, self.b2, self.clip_norm)


def lr_at(hp: Hyper, step):
  """Linear warm-up over `warmup` steps to `lr`, then cosine decay to lr * min_lr_ratio at
  `steps` (step counts from 0: the first update uses lr / warmup). jnp; traced fields allowed."""
  import jax.numpy as jnp

  step = jnp.asarray(step, jnp.float32)
  warmup = jnp.maximum(jnp.asarray(hp.warmup, jnp.float32), 1.0)
  warm = hp.lr * jnp.minimum(1.0, (step + 1) / warmup)
  frac = jnp.clip((step - hp.warmup) / jnp.maximum(hp.steps - hp.warmup, 1.0), 0.0, 1.0)
  cos = hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + jnp.cos(math.pi * frac)))
  return jnp.where(step < hp.warmup, warm, cos)


def lr_value(hp: Hyper, step: int) -> float:
  """`lr_at` in plain Python (for the logged curve)."""
  if step < hp.warmup:
    return hp.lr * min(1.0, (step + 1) / max(hp.warmup, 1))
  frac = min(max((step - hp.warmup) / max(hp.steps - hp.warmup, 1), 0.0), 1.0)
  return hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def optimizer(hp: Hyper):
  """Global-norm clipping, then AdamW with the `lr_at` schedule; weight decay on parameters of
  two or more dimensions (matrices, embedding), not on norms' weights and other vectors."""
  import jax
  import optax

  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(
    optax.clip_by_global_norm(hp.clip_norm),
    optax.adamw(
      functools.partial(lr_at, hp),
      b1=hp.b1,
      b2=hp.b2,
      weight_decay=hp.weight_decay,
      mask=decay_mask,
    ),
  )


def _loss_sums(graphdef, params, inputs, targets, seg):
  """(sum of nats over byte targets, number of byte targets)."""
  import jax.numpy as jnp
  import optax
  from flax import nnx

  logits = nnx.merge(graphdef, params)(inputs, segment_ids=seg)
  nats = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  counted = (targets < 256).astype(jnp.float32)
  return jnp.sum(nats * counted), jnp.sum(counted)


def _train_step(graphdef, static, schedule, params, opt_state, inputs, targets, seg):
  import jax
  import optax

  hp = Hyper(*(schedule[i] for i in range(4)), *static)

  def loss_fn(p):
    total, count = _loss_sums(graphdef, p, inputs, targets, seg)
    return total / count

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer(hp).update(grads, opt_state, params)
  norm = optax.tree.norm if hasattr(optax, "tree") else optax.global_norm
  return optax.apply_updates(params, updates), opt_state, loss, norm(grads)


@functools.cache
def compiled_steps(donate: bool):
  """(train_step, eval_sums) jitted with graphdef and the hyperparameters static."""
  import jax

  train = jax.jit(_train_step, static_argnums=(0, 1), donate_argnums=(3, 4) if donate else ())
  return train, jax.jit(_loss_sums, static_argnums=(0,))


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


# The HybridConfig fields that choose kernels or programs, not parameters: a checkpoint resumes
# across them (e.g. one written on a GPU with flash attention, resumed on a CPU; scanned layers
# keep one parameter entry per layer, so a checkpoint of either form loads in the other).
KERNEL_SETTINGS = ("implementation", "attn_impl", "scan_layers")


def model_settings(mc) -> dict:
  """The model's settings stored with each checkpoint and compared on resume (JSON values)."""
  fields = {k: v for k, v in dataclasses.asdict(mc).items() if k not in KERNEL_SETTINGS}
  fields["dtype"] = str(fields["dtype"])
  return json.loads(json.dumps(fields))


def _manager(out):
  """Checkpoints in OUT/checkpoints/<step>. Each save writes into `<step>.orbax-checkpoint-tmp-*`
  and renames it to `<step>` only when every file is written (orbax's atomic rename), so a save
  cut short (killed, out of disk) never shows as a step; leftover temporary folders are removed
  when the next run opens the folder (docs/train_lm.md#checkpoints)."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint.path import atomicity

  return ocp.CheckpointManager(
    os.path.abspath(os.path.join(out, "checkpoints")),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=2,
      create=True,
      cleanup_tmp_directories=True,
      temporary_path_class=atomicity.AtomicRenameTemporaryPath,
    ),
  )


def _save(manager, step, params, opt_state, settings):
  """The state and the model's settings at `step`, waited for: the step exists (renamed from
  its temporary folder) when this returns."""
  import orbax.checkpoint as ocp

  manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(dict(params=params, opt_state=opt_state)),
      model=ocp.args.JsonSave(settings),
    ),
    force=True,
  )
  manager.wait_until_finished()  # the next step donates these buffers


def _one_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 or len(lines) > 1 else ''}"


@contextlib.contextmanager
def _quiet_closed_loop_callbacks():
  """Drops the "Event loop is closed" RuntimeErrors that tensorstore's late callbacks raise, as
  unraisable exceptions, after orbax gave up reading a corrupted checkpoint (dozens of
  tracebacks for one unreadable step); every other unraisable exception is still reported."""
  previous = sys.unraisablehook

  def hook(unraisable):
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    sys.unraisablehook = previous


def _restore(manager, params, opt_state, settings, say):
  with _quiet_closed_loop_callbacks():
    return _restore_latest_readable(manager, params, opt_state, settings, say)


def _restore_latest_readable(manager, params, opt_state, settings, say):
  """(step, path, params, opt_state) of the latest readable checkpoint, or None when there is
  none (said through `say`). An unreadable step (corrupted files, garbage metadata, an empty
  folder) is reported in one line and the one before it is tried; a checkpoint of another model
  (other `model_settings`) is a TrainLMError naming the differing settings. An unreadable step
  folder is renamed `<step>.unreadable` (kept to inspect, out of the way of a new save)."""
  import jax
  import orbax.checkpoint as ocp

  folder = str(manager.directory)
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    say(f"--resume: nothing to resume (no checkpoint in {folder}); starting from step 0")
    return None
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, dict(params=params, opt_state=opt_state))

  def set_aside(step, path, error):
    # Renamed, not deleted: out of the way of this run's own save of that step, kept to inspect.
    aside = path + ".unreadable"
    n = 1
    while os.path.exists(aside):
      n += 1
      aside = f"{path}.unreadable-{n}"
    os.rename(path, aside)
    manager.reload()
    say(
      f"--resume: checkpoint step {step} ({path}) is unreadable ({_one_line(error)}); moved to "
      f"{os.path.basename(aside)}, trying the step before"
    )

  for step in steps:
    path = os.path.join(folder, str(step))
    try:
      if os.path.isdir(os.path.join(path, "default")) and not os.path.isdir(
        os.path.join(path, "model")
      ):
        raise TrainLMError("written by an older train-lm, without the model's settings")
      saved = manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))
      stored = saved["model"]
      if not isinstance(stored, dict):
        raise TypeError(f"the stored model settings are a {type(stored).__name__}, not a dict")
    except Exception as e:  # anything unreadable: fall back to the step before
      set_aside(step, path, e)
      continue
    differ = [k for k in sorted(set(settings) | set(stored)) if stored.get(k) != settings.get(k)]
    if differ:
      what = ", ".join(f"{k} {stored.get(k)!r} there, {settings.get(k)!r} here" for k in differ)
      raise TrainLMError(
        f"the checkpoint at step {step} ({path}) is of another model ({what}): resume with the "
        f"options that wrote it, or train into another --out"
      )
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
      state = state["state"]
    except Exception as e:
      set_aside(step, path, e)
      continue
    return step, path, state["params"], state["opt_state"]
  say(f"--resume: no readable checkpoint in {folder}; starting from step 0")
  return None


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def _device_kind():
  import jax

  d = jax.devices()[0]
  return getattr(d, "device_kind", d.platform)


def _command():
  """The command as typed when run as `python -m examples.byte_lm`, else None."""
  from benchmarks.bench import command_line

  return command_line() if "examples.byte_lm" in getattr(sys, "orig_argv", []) else None


def _metrics_path(out):
  return os.path.join(out, "metrics.json")


def train_lm(config: TrainConfig | None = None, **overrides) -> dict:
  """Train one model; returns the metrics dict (also written to `out`/metrics.json with the
  curves in `out`/curves.png when `out` is set). `train_lm(preset_config("tiny"))`, or
  `train_lm(preset="tiny", model="gdn", steps=30)`."""
  import jax
  import jax.numpy as jnp
  import tqdm
  from flax import nnx

  from gdp_jax.models import HybridLM

  if config is None:
    config = preset_config(overrides.pop("preset", "tiny"), **overrides)
  elif overrides:
    config = dataclasses.replace(config, **overrides)
  cfg = config
  cfg.validate()
  wall0 = time.perf_counter()
  mc = model_config(cfg)
  corpus = load_corpus(cfg.corpus_dir, cfg.val_percent)
  model = HybridLM(mc, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model)
  del model
  donate = jax.default_backend() != "cpu"
  train_step, eval_sums = compiled_steps(donate)
  val_set = [
    tuple(jnp.asarray(a) for a in b)
    for b in val_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
  ]
  fpt = flops_per_token(mc, cfg.seq_len)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  name = cfg.model
  quiet = cfg.progress is False

  def log(msg):
    if not quiet:
      print(msg, flush=True)

  def say(msg):  # what --resume found: shown even without progress output
    print(msg, file=sys.stderr, flush=True)

  previous = None
  if cfg.resume and os.path.exists(_metrics_path(cfg.out)):
    with open(_metrics_path(cfg.out)) as f:
      previous = json.load(f)
  steps = cfg.steps
  if previous is not None and cfg.minutes is not None:
    steps = previous["summary"]["schedule_steps"]  # the budget was resolved before

  def batch(step):
    return tuple(
      jnp.asarray(a) for a in train_batch(corpus.train, step, cfg.seed, cfg.batch_size, cfg.seq_len)
    )

  def hyper(n_steps):
    return Hyper(
      cfg.lr,
      cfg.min_lr_ratio,
      min(cfg.warmup_steps, n_steps // 2),
      n_steps,
      cfg.weight_decay,
      cfg.b1,
      cfg.b2,
      cfg.clip_norm,
    )

  scanned = ", layers scanned" if mc.scanned else ""  # docs/train_lm.md#compile-time
  log(
    f"train-lm: model {name} ({mc.layer_pattern}{scanned}), {count_params(params) / 1e6:.2f}M "
    f"parameters, backend {jax.default_backend()} ({_device_kind()}); corpus "
    f"{corpus.info['train_files']} + {corpus.info['val_files']} files, "
    f"{corpus.info['train_tokens'] / 1e6:.2f}M + {corpus.info['val_tokens'] / 1e6:.2f}M tokens"
  )

  # --minutes: time a few steps (on copies; compilation excluded) and size the schedule.
  t0 = time.perf_counter()
  opt_state = optimizer(hyper(steps)).init(params)
  compile_s = None
  if cfg.minutes is not None and previous is None:
    probe = jax.tree.map(jnp.copy, (params, opt_state))
    probe_hp = hyper(steps)
    b = batch(0)

    def probe_step(probe):
      p, o, loss, _ = train_step(graphdef, probe_hp.static(), probe_hp.schedule_array(), *probe, *b)
      return (p, o), loss

    probe, loss = probe_step(probe)
    float(loss)
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(3):
      probe, loss = probe_step(probe)
    float(loss)
    step_s = (time.perf_counter() - t1) / 3
    steps = max(2, int(cfg.minutes * 60 / step_s))
    del probe
    log(f"--minutes {cfg.minutes:g}: {step_s * 1e3:.1f} ms per step -> {steps} steps")
    opt_state = optimizer(hyper(steps)).init(params)
  hp = hyper(steps)
  stop = min(steps, cfg.stop_at or steps)
  # Committed to the device, like restored checkpoints: a resumed run in the same process then
  # reuses the compiled step (committed and uncommitted arguments compile separately).
  params, opt_state = jax.device_put((params, opt_state), jax.devices()[0])

  history: dict[str, list] = dict(step=[], train_loss=[], grad_norm=[], lr=[], tokens_per_s=[])
  evals = []
  start = 0
  manager = _manager(cfg.out) if (cfg.out and cfg.checkpoint) else None
  settings = model_settings(mc)
  if cfg.resume:
    restored = _restore(manager, params, opt_state, settings, say)
    if restored is None:
      previous = None  # a fresh start keeps none of the old curves
    else:
      start, path, params, opt_state = restored
      if previous is not None:
        old = previous["history"]
        keep = [i for i, s in enumerate(old["step"]) if s <= start]
        history = {k: [old[k][i] for i in keep] for k in ("step", "train_loss", "grad_norm", "lr")}
        history["tokens_per_s"] = [x for x in old["tokens_per_s"] if x[0] <= start]
        evals = [e for e in previous["eval"] if e["step"] <= start]
      say(f"--resume: resumed from step {start} ({path})")
      if start >= stop:
        say(
          f"--resume: nothing to train: the checkpoint is at step {start} and the run ends at "
          f"step {stop} (--steps {steps}" + (f", --stop-at {cfg.stop_at})" if cfg.stop_at else ")")
        )
        if manager is not None:
          manager.close()
        if previous is not None:
          return previous
        untrained: dict[str, Any] = dict(compile_s=None, train_s=0.0, timed_steps=0)
        untrained.update(stopped_at=None, resumed_from=start, command=_command())
        return _metrics(cfg, mc, corpus, params, fpt, history, evals, steps, start, untrained)
  if cfg.out:
    os.makedirs(cfg.out, exist_ok=True)

  def evaluate(step, elapsed):
    total = count = 0.0
    for inputs, targets, seg in val_set:
      t, c = eval_sums(graphdef, params, inputs, targets, seg)
      total, count = total + float(t), count + float(c)
    loss = total / count
    evals.append(
      dict(
        step=step,
        val_loss=loss,
        val_bpb=loss / math.log(2),
        tokens_seen=step * tokens_per_step,
        train_seconds=elapsed,
      )
    )
    return loss

  elapsed_before = evals[-1]["train_seconds"] if evals else 0.0
  if not any(e["step"] == start for e in evals):
    evaluate(start, elapsed_before)

  bar = tqdm.tqdm(
    total=steps,
    initial=start,
    desc=f"{name:>10}",
    disable=quiet,
    mininterval=0.5,
    dynamic_ncols=True,
  )
  pending: list = []  # (step, loss, grad norm) as device scalars, not yet fetched

  def flush():
    nonlocal pending
    if pending:
      vals = np.asarray(jax.device_get([(l, g) for _, l, g in pending]), np.float64)
      for (s, _, _), (l, g) in zip(pending, vals):
        history["step"].append(s)
        history["train_loss"].append(float(l))
        history["grad_norm"].append(float(g))
        history["lr"].append(lr_value(hp, s - 1))
      pending = []

  def write_metrics():
    if cfg.out:
      metrics = _metrics(cfg, mc, corpus, params, fpt, history, evals, steps, start, extra)
      with open(_metrics_path(cfg.out), "w") as f:
        json.dump(metrics, f, indent=1)

  extra = dict(
    compile_s=compile_s,
    train_s=0.0,
    timed_steps=0,
    stopped_at=None,
    resumed_from=start if cfg.resume and start else None,  # None: a fresh start
    command=_command(),
  )
  schedule = jnp.asarray(hp.schedule_array())
  t0 = t_mark = time.perf_counter()
  since_mark = 0
  step = start
  for step in range(start + 1, stop + 1):
    inputs, targets, seg = batch(step - 1)
    params, opt_state, loss, gnorm = train_step(
      graphdef, hp.static(), schedule, params, opt_state, inputs, targets, seg
    )
    pending.append((step, loss, gnorm))
    compiling = extra["compile_s"] is None
    if compiling:  # this process's first step compiles: not timed
      float(loss)
      extra["compile_s"] = time.perf_counter() - t0
    else:
      since_mark += 1
    is_eval = step % cfg.eval_every == 0 or step == stop
    is_ckpt = manager is not None and (
      step == stop or (cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0)
    )
    if compiling or is_eval or is_ckpt or step % cfg.log_every == 0:
      flush()
      now = time.perf_counter()
      recent = history["train_loss"][-max(since_mark, 1) :]
      stats: dict[str, Any] = dict(train_bpb=float(np.mean(recent)) / math.log(2))
      if since_mark:
        rate = since_mark * tokens_per_step / (now - t_mark)
        extra["train_s"] += now - t_mark
        extra["timed_steps"] += since_mark
        history["tokens_per_s"].append([step, rate])
        stats["tok_s"] = f"{rate / 1e3:.1f}k"
      if is_eval:
        evaluate(step, elapsed_before + extra["train_s"])
      stats["val_bpb"] = round(evals[-1]["val_bpb"], 3)  # the latest validation
      bar.set_postfix(stats, refresh=False)
      bar.update(step - bar.n)
      if is_ckpt:
        _save(manager, step, params, opt_state, settings)
      if is_eval or is_ckpt:
        write_metrics()
      t_mark, since_mark = time.perf_counter(), 0
  flush()
  bar.close()
  if stop < steps:
    extra["stopped_at"] = stop
  if manager is not None:
    manager.close()
  extra["wall_s"] = time.perf_counter() - wall0
  metrics = _metrics(cfg, mc, corpus, params, fpt, history, evals, steps, start, extra)
  if cfg.out:
    with open(_metrics_path(cfg.out), "w") as f:
      json.dump(metrics, f, indent=1)
    if cfg.plot:
      png = plot_runs([metrics], os.path.join(cfg.out, "curves.png"))
      if png:
        log(f"wrote {png}")
    log(f"wrote {_metrics_path(cfg.out)}")
  s = metrics["summary"]
  mfu = (
    f"MFU {_percent(s['mfu'], 2)} of {cfg.peak_tflops:g} TFLOP/s"
    if s["mfu"] is not None
    else "MFU n/a (off a GPU)"
  )
  log(
    f"{name}: val {s['final_val_bpb']:.4f} bits/byte at step {s['final_step']} "
    f"(from {evals[0]['val_bpb']:.3f}); {s['tokens_per_s'] or 0:,.0f} tokens/s, {mfu}; "
    f"compile {s['compile_s'] or 0:.1f}s, wall {s['wall_s']:.1f}s"
  )
  return metrics


def _metrics(cfg, mc, corpus, params, fpt, history, evals, steps, start, extra):
  import jax

  timed = extra["timed_steps"]
  tokens_per_step = cfg.batch_size * cfg.seq_len
  rate = timed * tokens_per_step / extra["train_s"] if timed and extra["train_s"] > 0 else None
  final = evals[-1] if evals else {}
  n_params = count_params(params)
  embed = VOCAB_SIZE * cfg.hidden_size * (1 if mc.tie_embeddings else 2)
  return dict(
    schema=SCHEMA,
    date=time.strftime("%Y-%m-%d %H:%M:%S"),
    command=extra.get("command"),
    config=dataclasses.asdict(cfg),
    model_config={k: (str(v) if k == "dtype" else v) for k, v in dataclasses.asdict(mc).items()},
    backend=jax.default_backend(),
    device=_device_kind(),
    jax=jax.__version__,
    python=platform.python_version(),
    corpus=corpus.info,
    params=n_params,
    non_embedding_params=n_params - embed,
    flops_per_token=fpt,
    peak_tflops=cfg.peak_tflops,
    flops_doc=(
      "matmul FLOPs per token, training = 3 x forward: projections, SwiGLU MLP, "
      "vocabulary head, causal attention 2*Hq*Dh*(T+1) per layer, the operator's "
      "chunked form as benchmarks/bench.py counts it; docs/train_lm.md"
    ),
    history=history,
    eval=evals,
    summary=dict(
      schedule_steps=steps,
      final_step=history["step"][-1] if history["step"] else start,
      tokens=(history["step"][-1] if history["step"] else start) * tokens_per_step,
      tokens_per_step=tokens_per_step,
      final_val_loss=final.get("val_loss"),
      final_val_bpb=final.get("val_bpb"),
      best_val_bpb=min((e["val_bpb"] for e in evals), default=None),
      initial_val_bpb=evals[0]["val_bpb"] if evals else None,
      tokens_per_s=rate,
      step_ms=(tokens_per_step / rate * 1e3) if rate else None,
      achieved_tflops=(rate * fpt["train"] / 1e12) if rate else None,
      # MFU against a GPU's peak: n/a (None) on other backends.
      mfu=(rate * fpt["train"] / (cfg.peak_tflops * 1e12))
      if rate and jax.default_backend() == "gpu"
      else None,
      compile_s=extra["compile_s"],
      train_s=extra["train_s"],
      timed_steps=timed,
      wall_s=extra.get("wall_s"),
      stopped_at=extra["stopped_at"],
      resumed_from=extra["resumed_from"],
      tokens_per_s_note="steady state: steps of this process after its first (compiling) "
      "one, evaluation and checkpoints excluded; every position of the "
      "batch counts (BOS and PAD included)",
    ),
  )


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------


def plot_runs(runs, path):
  """Train and validation bits per byte against tokens, and tokens/s, for one or more metrics
  dicts; returns the path, or None without matplotlib."""
  try:
    from matplotlib.figure import Figure
  except ImportError:
    print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return None
  fig = Figure(figsize=(12, 4.2))
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  for i, m in enumerate(runs):
    color = f"C{i}"
    label = (
      f"{m['config']['model']} ({m['params'] / 1e6:.0f}M)"
      if m["params"] >= 1e6
      else f"{m['config']['model']} ({m['params'] / 1e3:.0f}K)"
    )
    per_step = m["summary"]["tokens_per_step"]
    h = m["history"]
    if h["step"]:
      bpb = np.asarray(h["train_loss"]) / math.log(2)
      k = max(1, len(bpb) // 50)
      smooth = np.convolve(bpb, np.ones(k) / k, mode="valid")
      ax1.plot(np.asarray(h["step"][k - 1 :]) * per_step, smooth, color=color, alpha=0.45, lw=1)
    ev = m["eval"]
    ax1.plot(
      [e["tokens_seen"] for e in ev],
      [e["val_bpb"] for e in ev],
      "o-",
      color=color,
      ms=3,
      label=f"{label} val {ev[-1]['val_bpb']:.3f}",
    )
    if h["tokens_per_s"]:
      tps = np.asarray(h["tokens_per_s"])
      ax2.plot(tps[:, 0] * per_step, tps[:, 1], color=color, label=label)
  ax1.set_xlabel("training tokens")
  ax1.set_ylabel("bits per byte")
  ax1.set_title("train (faint, smoothed) and validation (dots) bits per byte")
  ax1.legend(fontsize=8)
  ax1.grid(alpha=0.3)
  ax2.set_xlabel("training tokens")
  ax2.set_ylabel("tokens / s")
  ax2.set_ylim(bottom=0)
  ax2.set_title("throughput (steady state)")
  ax2.legend(fontsize=8)
  ax2.grid(alpha=0.3)
  first = runs[0]
  fig.suptitle(f"train-lm, preset {first['config']['preset']}, {first['device']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def compare(paths, out) -> int:
  """A table and one figure for several runs' metrics.json files."""
  runs = []
  for p in paths:
    with open(p) as f:
      runs.append(json.load(f))
  print(
    f"{'model':<10} {'params':>8} {'steps':>6} {'tokens':>9} {'val bpb':>8} "
    f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
  )
  for m in runs:
    s = m["summary"]
    print(
      f"{m['config']['model']:<10} {m['params'] / 1e6:7.1f}M {s['final_step']:>6} "
      f"{s['tokens'] / 1e6:8.1f}M {s['final_val_bpb']:8.4f} {s['tokens_per_s'] or 0:10,.0f} "
      f"{s['achieved_tflops'] or 0:8.1f} {_percent(s['mfu'], 1):>6}"
    )
  if out:
    os.makedirs(out, exist_ok=True)
    png = plot_runs(runs, os.path.join(out, "compare.png"))
    if png:
      print(f"wrote {png}")
  return 0


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_arguments(p):
  bool_flag = argparse.BooleanOptionalAction
  p.add_argument(
    "--preset",
    default="tiny",
    choices=list(PRESETS),
    help="tiny (a CPU, about a minute) or h200 (about 117M parameters, T = 4096)",
  )
  p.add_argument(
    "--model",
    default="gdp-r2",
    choices=list(MODELS),
    help="attention (every layer), gdn (Gated DeltaNet, mask = ones), gdp-r2, "
    "gdp-r4 (block mask r = 2, 4), dp-2 (Householder DeltaProduct, n_h = 2) (default gdp-r2)",
  )
  p.add_argument("--out", default=None, help="folder for metrics.json, curves.png, checkpoints")
  p.add_argument("--steps", type=int, default=None, help="schedule length (preset's default)")
  p.add_argument(
    "--minutes",
    type=float,
    default=None,
    help="instead of --steps: as many steps as fit in this many minutes of "
    "training (timed on a few steps after compiling)",
  )
  p.add_argument(
    "--stop-at",
    type=int,
    default=None,
    help="stop after this step (checkpointed); --resume continues",
  )
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  p.add_argument("--checkpoint", default=True, action=bool_flag, help="orbax checkpoints")
  p.add_argument("--ckpt-every", type=int, default=None, help="steps between checkpoints")
  for flag, kind, what in (
    ("--batch-size", int, "sequences per step"),
    ("--seq-len", int, "tokens per sequence (a multiple of 64)"),
    ("--lr", float, "peak learning rate"),
    ("--warmup-steps", int, "linear warm-up steps, at most half of --steps"),
    ("--eval-every", int, "steps between validations"),
    ("--eval-batches", int, "validation batches"),
    ("--log-every", int, "steps between progress updates"),
    ("--hidden-size", int, "model width"),
    ("--layers", str, "layer pattern (D: gated delta product, A: attention)"),
    ("--seed", int, "initialisation and batch order"),
  ):
    p.add_argument(flag, type=kind, default=None, help=what + " (preset's default)")
  p.add_argument(
    "--dtype",
    default="bf16",
    choices=["bf16", "f32"],
    help="compute dtype (parameters are float32)",
  )
  p.add_argument(
    "--implementation",
    default=None,
    choices=list(IMPLEMENTATIONS),
    help="operator (default: Pallas on a supported GPU, xla elsewhere; docs/implementations.md)",
  )
  p.add_argument(
    "--attn-impl",
    default="auto",
    choices=["auto", "xla", "flash"],
    help="attention (auto: flash on a GPU, xla elsewhere)",
  )
  p.add_argument(
    "--scan-layers",
    default=False,
    action=bool_flag,
    help="layers of one configuration under jax.lax.scan, compiled once: a faster first compile, "
    "slower steps on a GPU today (default off; docs/train_lm.md#compile-time)",
  )
  p.add_argument(
    "--compilation-cache",
    default=None,
    metavar="DIR",
    help="jax's persistent compilation cache (default $GDP_JAX_COMPILATION_CACHE or "
    "~/.cache/gdp_jax/jax; 'off': none; docs/train_lm.md#compile-time)",
  )
  p.add_argument(
    "--peak-tflops",
    type=float,
    default=989.0,
    help="peak bf16 TFLOP/s for MFU (989: H100/H200 dense)",
  )
  p.add_argument(
    "--corpus-dir",
    default=None,
    help="folder of .py files (default: this interpreter's standard library)",
  )
  p.add_argument("--val-percent", type=float, default=2.0, help="validation files, percent")
  p.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
  p.add_argument("--no-plot", action="store_true", help="no PNG")
  p.set_defaults(train_lm_prog=p.prog)
  p.add_argument(
    "--compare",
    nargs="+",
    default=None,
    metavar="JSON",
    help="no training: a table and compare.png (in --out) of these metrics.json",
  )


def run(args) -> int:
  """The command line: 0, or 2 after a one-line message for a bad option, corpus or checkpoint
  (TrainLMError; argparse's convention, no traceback)."""
  try:
    return _run(args)
  except TrainLMError as e:
    print(f"{getattr(args, 'train_lm_prog', 'train-lm')}: error: {e}", file=sys.stderr)
    return 2


def _run(args) -> int:
  if getattr(args, "compilation_cache", None) is not None:  # (on by default: __main__.py)
    from gdp_jax import compilation_cache

    compilation_cache.enable(args.compilation_cache)
  if args.compare:
    for path in args.compare:
      if not os.path.isfile(path):
        raise TrainLMError(f"--compare: no file {path!r}")
    return compare(args.compare, args.out)
  overrides = dict(
    model=args.model,
    out=args.out,
    minutes=args.minutes,
    stop_at=args.stop_at,
    resume=args.resume,
    checkpoint=args.checkpoint,
    dtype=args.dtype,
    implementation=args.implementation,
    attn_impl=args.attn_impl,
    scan_layers=getattr(args, "scan_layers", False),
    peak_tflops=args.peak_tflops,
    corpus_dir=args.corpus_dir,
    val_percent=args.val_percent,
    plot=not args.no_plot,
    progress=False if args.no_progress else None,
  )
  for key in (
    "steps",
    "ckpt_every",
    "batch_size",
    "seq_len",
    "lr",
    "warmup_steps",
    "eval_every",
    "eval_batches",
    "log_every",
    "hidden_size",
    "layers",
    "seed",
  ):
    value = getattr(args, key)
    if value is not None:
      overrides[key] = value
  cfg = preset_config(args.preset, **overrides)
  if args.ckpt_every is not None and args.ckpt_every < 1:
    raise TrainLMError(
      f"--ckpt-every must be >= 1 (steps between checkpoints; the last step is always saved), "
      f"got {args.ckpt_every}"
    )
  if args.warmup_steps is not None and cfg.minutes is None and args.warmup_steps > cfg.steps // 2:
    raise TrainLMError(
      f"--warmup-steps {args.warmup_steps} is more than half the schedule ({cfg.steps} steps): "
      f"warm-up takes at most half of it"
    )
  train_lm(cfg)
  return 0
