r"""A verifiable reward on CPU: sums, SFT, then GRPO with exact_match, against more SFT.

Writes prompt/answer JSONL of two-number sums ("23+41=" -> "64"), SFTs a small char-level
conditional model on them (`configs/conditional.py`'s data, a tiny network), then from that
workdir (a) post-trains it with exact_match (GRPO) and (b) continues SFT for about the same wall
time (as many more steps as the first SFT's pace gives; its learning-rate schedule is stretched
to the new end).
Accuracy on held-out prompts (greedy decoding, an answer right when its tokens up to EOS are the
answer's) ± SE, before and after each. Prints JSON.

  python benchmarks/post_training_arithmetic.py --dir=/tmp/md4jax_sums
"""

import json
import pathlib
import shutil
import time

import jax
import numpy as np
from absl import app, flags

import md4jax
from md4jax import config as config_lib
from md4jax.app import modes, post_train

_DIR = flags.DEFINE_string("dir", "/tmp/md4jax_sums", "Where the data and workdirs go.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 1500, "SFT steps before post-training.")
_POST_STEPS = flags.DEFINE_integer("post_steps", 100, "GRPO steps.")
_EVAL = flags.DEFINE_integer("eval_prompts", 400, "Held-out prompts scored.")
_MAX = flags.DEFINE_integer("max_operand", 50, "Operands are drawn in [0, max_operand).")
_LEARNING_RATE = flags.DEFINE_float("post_learning_rate", 3e-4, "GRPO's peak learning rate.")
_BETA = flags.DEFINE_float("post_beta", 0.01, "GRPO's KL coefficient.")
_GROUP = flags.DEFINE_integer("post_group_size", 8, "GRPO's rollouts per prompt.")
_LIKELIHOOD = flags.DEFINE_enum(
  "post_likelihood", "nelbo", ["nelbo", "d1", "coupled"], "GRPO's log-likelihood estimator."
)
_DRAWS = flags.DEFINE_integer("post_likelihood_draws", 1, "Its draws (nelbo, coupled).")
_TEMPERATURE = flags.DEFINE_float("post_temperature", 1.0, "The rollouts' temperature.")
_SKIP_SFT = flags.DEFINE_bool("reuse_sft", False, "Reuse DIR/sft from an earlier run.")
_MORE_SFT = flags.DEFINE_bool("more_sft", True, "Also run more SFT for GRPO's wall time.")


def _write_sums(path: pathlib.Path, pairs: np.ndarray):
  with path.open("w") as f:
    for a, b in pairs:
      f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")


def _data(root: pathlib.Path) -> list:
  """Train on every pair but the held-out ones; returns the held-out (prompt, answer)s."""
  everything = np.array([(a, b) for a in range(_MAX.value) for b in range(_MAX.value)])
  order = np.random.default_rng(0).permutation(len(everything))
  held_out, train = everything[order[: _EVAL.value]], everything[order[_EVAL.value :]]
  _write_sums(root / "train.jsonl", train)
  return [(f"{a}+{b}=", str(a + b)) for a, b in held_out]


def _sft_config(root: pathlib.Path, steps: int):
  config = config_lib.load_config("tiny")
  config.data.update(dataset="conditional", path=str(root / "train.jsonl"), vocab_size=0)
  config.data.update(tokenizer="char", seq_len=10)
  config.model.update(num_layers=2, model_dim=64, num_heads=4, mlp_dim=256)
  config.batch_size = 64
  config.optimizer.update(learning_rate=3e-3, warmup_steps=50, ema_decay=0.99)
  config.num_train_steps = steps
  config.eval_every_steps = config.checkpoint_every_steps = config.log_every_steps = steps
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  return config


def accuracy(workdir, held_out: list) -> dict:
  """Greedy answers to the held-out prompts: the share right ± its SE."""
  loaded = md4jax.load(workdir)
  tokenizer, length = loaded.tokenizer, loaded.config.data.seq_len
  prompts = np.zeros((len(held_out), length), np.int32)
  given = np.zeros((len(held_out), length), bool)
  for row, (prompt, _) in enumerate(held_out):
    ids = tokenizer.encode(prompt)
    prompts[row, : len(ids)], given[row, : len(ids)] = ids, True
  tokens, _ = md4jax.sample(
    jax.random.PRNGKey(0),
    loaded.denoise_fn,
    batch_size=len(held_out),
    length=length,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    method="confidence",
    num_steps=length,
    temperature=0.0,
    prompt=prompts,
    prompt_mask=given,
    eos_id=tokenizer.eos_id,
  )
  right = []
  for row, (_, answer) in enumerate(held_out):
    generated = np.asarray(tokens[row])[~given[row]]
    ends = np.flatnonzero(generated == tokenizer.eos_id)
    text = tokenizer.decode(generated[: ends[0]]) if len(ends) else None
    right.append(text == answer)
  right = np.asarray(right, np.float64)
  return {"accuracy": right.mean(), "stderr": right.std(ddof=1) / np.sqrt(len(right))}


def main(argv):
  del argv
  root = pathlib.Path(_DIR.value)
  if _SKIP_SFT.value:
    held_out = _data(root)  # The same split: its seed is fixed.
    sft_seconds = json.loads((root / "sft_seconds.json").read_text())
    for name in ("grpo", "more_sft"):
      shutil.rmtree(root / name, ignore_errors=True)
  else:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    held_out = _data(root)
    started = time.perf_counter()
    modes.train_and_evaluate(_sft_config(root, _SFT_STEPS.value), root / "sft")
    sft_seconds = time.perf_counter() - started
    (root / "sft_seconds.json").write_text(json.dumps(sft_seconds))
  report = {"sft_steps": _SFT_STEPS.value, "sft_seconds": sft_seconds}
  report["sft"] = accuracy(root / "sft", held_out)

  post = _sft_config(root, _POST_STEPS.value)
  post.update(batch_size=16, log_every_steps=10, checkpoint_every_steps=_POST_STEPS.value)
  post.optimizer.update(
    learning_rate=_LEARNING_RATE.value, warmup_steps=min(5, _POST_STEPS.value - 1), ema_decay=0.0
  )
  post.sample.update(method="confidence", num_steps=4, temperature=_TEMPERATURE.value)
  post.post_train.update(init_from=str(root / "sft"), reward="exact_match", algorithm="grpo")
  post.post_train.update(
    group_size=_GROUP.value,
    beta=_BETA.value,
    likelihood=_LIKELIHOOD.value,
    likelihood_draws=_DRAWS.value,
  )
  started = time.perf_counter()
  post_train.post_train(post, root / "grpo")
  grpo_seconds = time.perf_counter() - started
  report.update(
    grpo_steps=_POST_STEPS.value,
    grpo_seconds=grpo_seconds,
    grpo_learning_rate=_LEARNING_RATE.value,
    grpo_beta=_BETA.value,
    grpo_group_size=_GROUP.value,
    grpo_likelihood=f"{_LIKELIHOOD.value} x{_DRAWS.value}",
    grpo_temperature=_TEMPERATURE.value,
  )
  report["grpo"] = accuracy(root / "grpo", held_out)

  # More SFT for the same wall time, at the first run's pace (compilation and its evaluation
  # included): the SFT workdir copied and resumed to that many more steps.
  if not _MORE_SFT.value:
    print(json.dumps(report, indent=2))
    return
  shutil.copytree(root / "sft", root / "more_sft")
  more = int(round(grpo_seconds * _SFT_STEPS.value / sft_seconds))
  started = time.perf_counter()
  modes.train_and_evaluate(_sft_config(root, _SFT_STEPS.value + more), root / "more_sft")
  report.update(more_sft_steps=more, more_sft_seconds=time.perf_counter() - started)
  report["more_sft"] = accuracy(root / "more_sft", held_out)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
