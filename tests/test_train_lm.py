"""train-lm: the tiny preset learns, a checkpoint resumes to the same step and losses, the corpus
rules and split are deterministic, packed documents do not see each other (exactly zero
gradient across documents through the whole model), the FLOP count and the command line.

The runs share one compilation (the train step is jitted at module level with the model's
graph static), so only the first run of the module pays for it.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples.byte_lm import train_lm as tl
from gdp_jax.models import HybridConfig, HybridLM

QUIET = dict(progress=False)


def test_tiny_preset_trains_and_validation_loss_goes_down(tmp_path):
  out = str(tmp_path / "tiny")
  m = tl.train_lm(tl.preset_config("tiny", out=out, **QUIET))
  ev = m["eval"]
  assert [e["step"] for e in ev] == [0, 20, 40, 60]
  assert ev[0]["val_bpb"] > 7.5  # about log2(258) = 8.0 at initialisation
  assert ev[-1]["val_bpb"] < ev[0]["val_bpb"] - 2.5  # about 4.3 after 60 steps
  assert ev[2]["val_bpb"] < ev[1]["val_bpb"] < ev[0]["val_bpb"]
  assert m["history"]["step"] == list(range(1, 61))
  assert np.mean(m["history"]["train_loss"][-10:]) < np.mean(m["history"]["train_loss"][:10])
  s = m["summary"]
  assert s["final_step"] == 60 and s["tokens"] == 60 * 8 * 128
  assert s["tokens_per_s"] > 0 and s["achieved_tflops"] > 0
  # MFU is measured against a GPU's peak: n/a (None) on the CPU.
  assert s["mfu"] is None if jax.default_backend() != "gpu" else 0 < s["mfu"] < 1
  assert m["corpus"]["root"] == "stdlib"  # no machine path in the metrics
  assert m["flops_per_token"]["train"] == 3 * m["flops_per_token"]["forward"]
  assert m["corpus"]["val_files"] > 0 and m["corpus"]["train_files"] > 10 * m["corpus"]["val_files"]
  with open(os.path.join(out, "metrics.json")) as f:
    assert json.load(f)["summary"]["final_val_bpb"] == s["final_val_bpb"]
  assert os.path.isdir(os.path.join(out, "checkpoints", "60"))
  try:
    import matplotlib  # noqa: F401

    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
  except ImportError:
    pass


def test_checkpoint_resumes_to_the_same_step_and_loss(tmp_path):
  """Stopped at step 3 of 6 (checkpointed) and resumed: the same losses as an uninterrupted
  run, step for step, and the same final validation loss."""
  base = dict(steps=6, eval_every=3, plot=False, **QUIET)
  full = tl.train_lm(tl.preset_config("tiny", out=str(tmp_path / "full"), **base))
  part_dir = str(tmp_path / "part")
  part = tl.train_lm(tl.preset_config("tiny", out=part_dir, stop_at=3, **base))
  assert part["summary"]["final_step"] == 3 and part["summary"]["stopped_at"] == 3
  assert os.path.isdir(os.path.join(part_dir, "checkpoints", "3"))
  rest = tl.train_lm(tl.preset_config("tiny", out=part_dir, resume=True, **base))
  assert rest["summary"]["resumed_from"] == 3
  assert rest["history"]["step"] == full["history"]["step"] == [1, 2, 3, 4, 5, 6]
  assert rest["history"]["train_loss"] == full["history"]["train_loss"]
  assert [e["step"] for e in rest["eval"]] == [0, 3, 6]
  assert rest["eval"][-1]["val_loss"] == full["eval"][-1]["val_loss"]


def test_corpus_rules_and_split_are_deterministic(tmp_path):
  files = {
    "a.py": b"x = 1\n",
    "pkg/b.py": b"y = 2\n",
    "pkg/test/t.py": b"assert 1\n",
    "site-packages/s.py": b"skip\n",
    "pkg/__pycache__/c.py": b"skip\n",
    "empty.py": b"",
    "notes.txt": b"skip\n",
    "big.py": b"#" * (tl.MAX_FILE_BYTES + 1),
  }
  for rel, data in files.items():
    path = tmp_path / "root" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
  found = [rel for rel, _ in tl.corpus_files(str(tmp_path / "root"))]
  assert found == ["a.py", "pkg/b.py", "pkg/test/t.py"]
  shutil.copytree(tmp_path / "root", tmp_path / "elsewhere")
  assert [rel for rel, _ in tl.corpus_files(str(tmp_path / "elsewhere"))] == found

  # The split depends on the relative path only (pinned: a change of rule shows here).
  names = ("os.py", "json/decoder.py", "typing.py", "chunk.py", "copyreg.py", "email/__init__.py")
  assert [tl.is_validation(f, 2.0) for f in names] == [False, False, False, True, True, True]
  stdlib = [rel for rel, _ in tl.corpus_files()]
  val = [rel for rel in stdlib if tl.is_validation(rel, 2.0)]
  assert val == [rel for rel, _ in tl.corpus_files() if tl.is_validation(rel, 2.0)]
  assert 0.005 < len(val) / len(stdlib) < 0.05
  assert not any("site-packages" in rel or "__pycache__" in rel for rel in stdlib)
  assert tl.is_validation("a.py", 100 - 1e-9) and not tl.is_validation("a.py", 1e-12)

  a = tl.load_corpus(str(tmp_path / "root"), val_percent=50.0)
  b = tl.load_corpus(str(tmp_path / "elsewhere"), val_percent=50.0)
  assert a.info["sha256"] == b.info["sha256"]
  np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
  np.testing.assert_array_equal(a.val.tokens, b.val.tokens)


def test_packing_and_batches():
  stream = tl.pack([b"abc", b"x" * 70, b""])
  assert stream.tokens.size == 64 + 128 + 64
  starts = np.flatnonzero(stream.tokens == tl.BOS)
  np.testing.assert_array_equal(starts, [0, 64, 192])
  assert bytes(stream.tokens[1:4].astype(np.uint8)) == b"abc"
  assert np.all(stream.tokens[4:64] == tl.PAD) and np.all(stream.doc[:64] == 0)
  np.testing.assert_array_equal(stream.doc[64:192], 1)

  corpus = tl.load_corpus()
  x1 = tl.train_batch(corpus.train, 5, 0, 4, 128)
  x2 = tl.train_batch(corpus.train, 5, 0, 4, 128)
  x3 = tl.train_batch(corpus.train, 6, 0, 4, 128)
  for a, b in zip(x1, x2):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(x1[0], x3[0])
  inputs, targets, seg = (
    np.concatenate(a) for a in zip(*(tl.train_batch(corpus.train, s, 0, 8, 512) for s in range(20)))
  )
  np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
  rows, cols = np.nonzero(np.diff(seg, axis=1))
  starts = cols + 1  # a new document inside a window
  assert starts.size > 5 and np.all(starts % tl.ALIGN == 0)  # at multiples of 64
  assert np.all(inputs[rows, starts] == tl.BOS)
  val = tl.val_batches(corpus.val, 4, 128, 2)
  assert len(val) == 2 and all(v[0].shape == (4, 128) for v in val)


def test_packed_documents_do_not_see_each_other():
  """Through the whole model (gated delta product with short convolution, attention, MLP, bf16
  as in training): the gradient of one document's loss with respect to the embedded inputs of
  every other document in the row is exactly zero."""
  docs = [b"def f(x):\n    return x\n" * 5, b"import os\n", b"class A:\n    pass\n", b"#"]
  stream = tl.pack(docs)  # 128 + 64 + 64 + 64 tokens
  inputs, targets, seg = (jnp.asarray(a) for a in tl._windows(stream, np.asarray([64]), 192))
  config = HybridConfig(
    vocab_size=tl.VOCAB_SIZE,
    hidden_size=16,
    layer_pattern="DA",
    num_heads=2,
    head_dim=8,
    num_blocks=2,
    chunk_size=16,
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
    implementation="xla",
    dtype=jnp.bfloat16,
  )
  model = HybridLM(config, rngs=nnx.Rngs(0))
  ids = np.unique(np.asarray(seg))
  assert len(ids) == 3  # the end of document 0 (no BOS in the row), 1 and 2
  weights = jnp.stack([(seg == i) & (targets < 256) for i in ids]).astype(jnp.float32)

  def doc_loss(x, w):
    logits = model.from_embeddings(x, segment_ids=seg)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * w)

  x = model.embed(inputs).astype(jnp.bfloat16)
  grads = jax.jit(jax.vmap(jax.grad(doc_loss), in_axes=(None, 0)))(x, weights)
  grads = np.abs(np.asarray(grads, np.float32)).sum(-1)[:, 0]  # [docs, T]
  seg_np, counted = np.asarray(seg)[0], np.asarray(targets)[0] < 256
  for k, i in enumerate(ids):
    assert np.all(grads[k][seg_np != i] == 0), f"document {i} reaches another document"
    # every input that predicts a counted byte of the document has a gradient
    assert np.all(grads[k][(seg_np == i) & counted] > 0), f"document {i}: dead inputs"


def test_flops_per_token():
  c = HybridConfig(
    vocab_size=258,
    hidden_size=64,
    layer_pattern="DA",
    num_heads=2,
    head_dim=32,
    num_blocks=2,
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
  )
  f = tl.flops_per_token(c, 128)
  p = f["forward_parts"]
  D, HK = 64, 64
  assert (
    p["projections"]
    == 2 * D * (3 * HK + 4) + 2 * HK * D + 2 * D * HK + 2 * D * (64 + 2 * 32) + 2 * 64 * D
  )
  assert p["attention"] == 2 * 64 * 129
  assert p["mlp"] == 2 * (2 * 3 * D * 2 * D) and p["head"] == 2 * D * 258
  from benchmarks.bench import forward_flops

  assert p["operator"] == forward_flops(1, 128, 2, 32, 32, 2) / 128
  assert f["train"] == 3 * sum(p.values())


def test_command_line_and_bad_configuration(tmp_path, capsys):
  from examples.byte_lm.__main__ import main

  out = str(tmp_path / "cli")
  assert (
    main(
      [
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--out",
        out,
        "--no-plot",
      ]
    )
    == 0
  )
  text = capsys.readouterr().out
  assert "bits/byte" in text and "tokens/s" in text and "MFU" in text
  assert main(["--compare", os.path.join(out, "metrics.json"), "--out", out]) == 0
  assert "gdp-r2" in capsys.readouterr().out
  with pytest.raises(ValueError, match="seq_len must be a multiple of 64"):
    tl.train_lm(tl.preset_config("tiny", seq_len=100))
  with pytest.raises(ValueError, match="model must be one of"):
    tl.train_lm(tl.preset_config("tiny", model="mamba"))
  with pytest.raises(ValueError, match="resume and stop_at need an out folder"):
    tl.train_lm(tl.preset_config("tiny", resume=True))
  assert math.isclose(
    tl.lr_value(tl.Hyper(1.0, 0.1, 10, 100, 0, 0, 0, 0), 99),
    float(tl.lr_at(tl.Hyper(1.0, 0.1, 10, 100, 0, 0, 0, 0), 99)),
    rel_tol=1e-6,
  )


def test_profile_train_step_smoke(tmp_path):
  """benchmarks/profile_train_step.py --smoke (tiny preset): every part timed, the JSON written
  with its keys, the ratio step / (matmuls + operator + attention) a positive number."""
  import importlib.util

  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "profile_train_step.py")
  spec = importlib.util.spec_from_file_location("profile_train_step", path)
  prof = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(prof)
  out = str(tmp_path / "prof.json")
  prof.main(["--smoke", "--out", out])
  with open(out) as f:
    res = json.load(f)
  assert res["errors"] == {}
  for key in ("date", "jax", "device", "command", "preset", "model", "parts", "ratio", "sum_ms"):
    assert key in res, key
  assert res["preset"] == "tiny" and res["model"] == "gdp-r2"
  assert "/" not in res["command"].split("--out ")[1]  # absolute paths reduced
  parts = res["parts"]
  for key in ("step", "matmuls", "operator_per_layer", "operator_total", "attention_total"):
    assert parts[key] > 0, key
  assert parts["operator_total"] == parts["operator_per_layer"] * res["operator"]["layers"]
  assert res["matmuls"]["count"] == sum(
    "kernel" in s["param"] for s in res["matmuls"]["shapes"]
  )  # every dense projection and the head, not the embedding
  assert not any("embedding" in s["param"] for s in res["matmuls"]["shapes"])
  assert math.isfinite(res["ratio"]) and res["ratio"] > 0
  assert res["ratio"] == pytest.approx(parts["step"] / res["sum_ms"])


# ---- command-line errors, resume and checkpoints ------------------------------------------------


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--corpus-dir", "/nonexistent"], "corpus folder '/nonexistent' does not exist"),
    (["--steps", "0"], "steps must be a positive integer, got 0"),
    (["--steps", "-3"], "steps must be a positive integer, got -3"),
    (["--eval-every", "0"], "eval_every must be a positive integer, got 0"),
    (["--ckpt-every", "-1"], "--ckpt-every must be >= 1 (steps between checkpoints"),
    (["--ckpt-every", "0"], "--ckpt-every must be >= 1 (steps between checkpoints"),
    (["--steps", "10", "--warmup-steps", "6"], "--warmup-steps 6 is more than half the schedule"),
    (["--warmup-steps", "-1"], "warmup_steps must be a non-negative integer"),
    (["--seed", "-1"], "seed must be a non-negative integer"),
    (["--lr", "0"], "lr must be a positive number, got 0.0"),
    (["--seq-len", "100"], "seq_len must be a multiple of 64"),
    (["--layers", "DXA"], "model settings: layer_pattern = 'DXA' has unknown letters"),
    (["--hidden-size", "0"], "model settings: hidden_size must be a positive integer"),
    (["--hidden-size", "7"], "model settings: hidden_size = 7 is not divisible by num_heads = 2"),
    (["--hidden-size", "30"], "model settings: head_dim must be even for RoPE, got 15"),
    (["--resume"], "resume and stop_at need an out folder"),
    (["--compare", "/nonexistent/metrics.json"], "--compare: no file"),
  ],
)
def test_command_line_errors_are_one_line_with_status_2(argv, match, capsys):
  """Argument and data errors used to end in tracebacks: now one line on stderr, exit status 2
  (argparse's convention), nothing trained."""
  from examples.byte_lm.__main__ import main

  assert main(["--no-progress", *argv]) == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("python -m examples.byte_lm: error: ")
  assert match in lines[0]
  assert captured.out == ""


def _ckpt_dir(out):
  return os.path.join(out, "checkpoints")


def _corrupt_data(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(root) == "d":
      for name in files:
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"not an ocdbt file" * 8)


def _garbage_metadata(step_dir):
  with open(os.path.join(step_dir, "state", "_METADATA"), "w") as f:
    f.write("{garbage")


def _empty_folder(step_dir):
  shutil.rmtree(step_dir)
  os.mkdir(step_dir)


def test_resume_says_what_it_found(tmp_path, capsys):
  """--resume reports the step and path it resumed from, or that there was nothing to resume;
  --steps at the checkpoint's step trains nothing (it used to report "0 tokens/s"); an
  unreadable latest step (garbage data files, garbage _METADATA, an empty folder) is reported in
  one line and the step before is used; a checkpoint of another model is refused naming the
  settings that differ, on the command line in one line with status 2."""
  from examples.byte_lm.__main__ import main

  base = dict(eval_every=2, ckpt_every=2, plot=False, **QUIET)
  good = str(tmp_path / "good")
  tl.train_lm(tl.preset_config("tiny", out=good, steps=4, **base))
  assert sorted(os.listdir(_ckpt_dir(good))) == ["2", "4"]
  capsys.readouterr()

  # Nothing to resume: says so and starts fresh.
  fresh = tl.train_lm(
    tl.preset_config("tiny", out=str(tmp_path / "new"), steps=2, resume=True, **base)
  )
  err = capsys.readouterr().err
  assert "--resume: nothing to resume (no checkpoint in " in err and "starting from step 0" in err
  assert fresh["history"]["step"] == [1, 2]

  # At or past the schedule: nothing trained, nothing written.
  before = os.path.getmtime(os.path.join(good, "metrics.json"))
  m = tl.train_lm(tl.preset_config("tiny", out=good, steps=4, resume=True, **base))
  err = capsys.readouterr().err
  assert (
    f"--resume: resumed from step 4 ({os.path.join(os.path.abspath(good), 'checkpoints', '4')})"
    in err
  )
  assert (
    "nothing to train: the checkpoint is at step 4 and the run ends at step 4 (--steps 4)" in err
  )
  assert m["summary"]["final_step"] == 4 and m["history"]["step"] == [1, 2, 3, 4]
  assert os.path.getmtime(os.path.join(good, "metrics.json")) == before
  assert sorted(os.listdir(_ckpt_dir(good))) == ["2", "4"]
  bare = str(tmp_path / "bare")  # the same without metrics.json: a summary of the checkpoint
  shutil.copytree(good, bare)
  os.remove(os.path.join(bare, "metrics.json"))
  m = tl.train_lm(tl.preset_config("tiny", out=bare, steps=3, resume=True, **base))
  assert "the run ends at step 3 (--steps 3)" in capsys.readouterr().err
  assert m["summary"]["final_step"] == 4 and m["history"]["step"] == []
  assert not os.path.exists(os.path.join(bare, "metrics.json"))

  # A corrupted or partial latest step: one line, then the step before.
  for name, spoil in (
    ("data", _corrupt_data),
    ("meta", _garbage_metadata),
    ("empty", _empty_folder),
  ):
    out = str(tmp_path / name)
    shutil.copytree(good, out)
    spoil(os.path.join(_ckpt_dir(out), "4"))
    m = tl.train_lm(tl.preset_config("tiny", out=out, steps=4, resume=True, **base))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("--resume")]
    assert len(lines) == 2, (name, lines)
    assert lines[0].startswith("--resume: checkpoint step 4 (") and "is unreadable (" in lines[0]
    assert lines[0].endswith("moved to 4.unreadable, trying the step before"), lines[0]
    assert lines[1].startswith("--resume: resumed from step 2 ("), lines[1]
    assert m["summary"]["resumed_from"] == 2 and m["history"]["step"] == [1, 2, 3, 4]
    assert sorted(os.listdir(_ckpt_dir(out))) == ["2", "4", "4.unreadable"]

  # Every step unreadable: a fresh start, said clearly.
  out = str(tmp_path / "none")
  shutil.copytree(good, out)
  for step in ("2", "4"):
    _empty_folder(os.path.join(_ckpt_dir(out), step))
  m = tl.train_lm(tl.preset_config("tiny", out=out, steps=2, resume=True, **base))
  assert "--resume: no readable checkpoint in " in capsys.readouterr().err
  assert m["summary"]["resumed_from"] is None and m["history"]["step"] == [1, 2]

  # Another model: refused, naming the settings.
  with pytest.raises(
    tl.TrainLMError, match=r"another model \(mask_mode 'static' there, 'ones' here"
  ):
    tl.train_lm(tl.preset_config("tiny", out=good, model="gdn", steps=6, resume=True, **base))
  argv = ["--model", "gdn", "--steps", "6", "--out", good, "--resume", "--no-progress"]
  assert main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("python -m examples.byte_lm: error: the checkpoint")
  assert "num_blocks 2 there, 1 here" in err[0]


# The fault-injected run: orbax renames `<step>.orbax-checkpoint-tmp-*` to `<step>` when a save is
# complete; this run stops there at step 4 (every file written, not yet renamed) until killed.
KILLED_RUN = """
import sys, time
from orbax.checkpoint.path import atomicity

finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def paused_finalize(self):
  if self._final_path.name == "4":
    print("SAVE OF STEP 4 UNDER WAY", flush=True)
    time.sleep(300)
  return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = paused_finalize
from examples.byte_lm import train_lm as tl
tl.train_lm(tl.preset_config("tiny", out=sys.argv[1], steps=6, eval_every=2, ckpt_every=2,
                             progress=False, plot=False))
print("FINISHED", flush=True)
"""


def test_a_killed_save_loses_only_the_unfinished_step(tmp_path):
  """A run killed (SIGKILL) while the checkpoint of step 4 is being written: step 2 stays the
  latest readable step, and --resume continues from it to the same losses as a run never
  interrupted."""
  import signal
  import subprocess
  import sys
  import time

  out = str(tmp_path / "killed")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.Popen(
    [sys.executable, "-c", KILLED_RUN, out],
    cwd=root,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    deadline = time.monotonic() + 240
    seen = []
    for line in proc.stdout:
      seen.append(line)
      if "SAVE OF STEP 4 UNDER WAY" in line or time.monotonic() > deadline:
        break
    assert "SAVE OF STEP 4 UNDER WAY" in "".join(seen), "".join(seen[-30:])
    names = os.listdir(_ckpt_dir(out))
    assert "2" in names and "4" not in names
    assert any(n.startswith("4.orbax-checkpoint-tmp") for n in names), names
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL

  base = dict(steps=6, eval_every=2, ckpt_every=2, plot=False, **QUIET)
  rest = tl.train_lm(tl.preset_config("tiny", out=out, resume=True, **base))
  assert rest["summary"]["resumed_from"] == 2
  # The temporary folder of the unfinished save is gone; the run's own steps are there.
  assert sorted(os.listdir(_ckpt_dir(out))) == ["4", "6"]
  full = tl.train_lm(tl.preset_config("tiny", out=str(tmp_path / "full"), **base))
  assert rest["history"]["step"] == full["history"]["step"] == [1, 2, 3, 4, 5, 6]
  assert rest["history"]["train_loss"] == full["history"]["train_loss"]
  assert rest["eval"][-1]["val_loss"] == full["eval"][-1]["val_loss"]
