r"""A verifiable reward on CPU: sums, SFT, then GRPO with exact_match, against more SFT.

Writes prompt/answer JSONL of two-number sums ("23+41=" -> "64"), SFTs a small char-level
conditional model on them (`configs/conditional.py`'s data, a tiny network), then from that
workdir (a) post-trains it with exact_match (GRPO) and (b) continues SFT for about the same wall
time (as many more steps as the first SFT's pace gives; its learning-rate schedule is stretched
to the new end). With --sft_examples=N the SFT (and the more-SFT run) sees only the first N
training examples, and GRPO every training prompt: a verifier needs no demonstrations.
Accuracy on held-out prompts ± SE, before and after each: greedy decoding, and sampled as the
rollouts are (their sampler and temperature: what GRPO maximizes); an answer is right when its
tokens up to EOS are the answer's. Prints JSON.

  python benchmarks/post_training_arithmetic.py --dir=/tmp/md4jax_sums
"""

import json
import pathlib
import shutil
import time

import jax
import numpy as np
import sums_verifier
from absl import app, flags

import md4jax
from md4jax import config as config_lib
from md4jax.app import modes, post_train

_DIR = flags.DEFINE_string("dir", "/tmp/md4jax_sums", "Where the data and workdirs go.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 6000, "SFT steps before post-training.")
_POST_STEPS = flags.DEFINE_integer("post_steps", 200, "GRPO steps.")
_EVAL = flags.DEFINE_integer("eval_prompts", 400, "Held-out prompts scored.")
_MAX = flags.DEFINE_integer("max_operand", 50, "Operands are drawn in [0, max_operand).")
_LEARNING_RATE = flags.DEFINE_float("post_learning_rate", 1e-3, "GRPO's peak learning rate.")
_BETA = flags.DEFINE_float("post_beta", 0.0, "GRPO's KL coefficient.")
_GROUP = flags.DEFINE_integer("post_group_size", 16, "GRPO's rollouts per prompt.")
_PROMPTS = flags.DEFINE_integer("post_prompts", 64, "GRPO's prompts a step.")
_LIKELIHOOD = flags.DEFINE_enum(
  "post_likelihood", "nelbo", ["nelbo", "d1", "coupled"], "GRPO's log-likelihood estimator."
)
_DRAWS = flags.DEFINE_integer("post_likelihood_draws", 1, "Its draws (nelbo, coupled).")
_TEMPERATURE = flags.DEFINE_float("post_temperature", 1.0, "The rollouts' temperature.")
_SFT_EXAMPLES = flags.DEFINE_integer(
  "sft_examples", 500, "SFT on the first N training examples only (0: all of them)."
)
_SAMPLED_DRAWS = flags.DEFINE_integer("sampled_draws", 8, "Sampled answers per held-out prompt.")
_SKIP_SFT = flags.DEFINE_bool("reuse_sft", False, "Reuse DIR/sft from an earlier run.")
_MORE_SFT = flags.DEFINE_bool("more_sft", True, "Also run more SFT for GRPO's wall time.")
_VERIFIER = flags.DEFINE_bool(
  "verifier",
  False,
  "GRPO on prompts without answers, rewarded by sums_verifier (a + b computed from the prompt) "
  "instead of exact_match.",
)
ROLLOUT_STEPS = 4  # The rollouts' confidence steps, and the sampled accuracy's.


def _write_sums(path: pathlib.Path, pairs: np.ndarray, answers: bool = True):
  with path.open("w") as f:
    for a, b in pairs:
      response = str(a + b) if answers else ""
      f.write(json.dumps({"prompt": f"{a}+{b}=", "response": response}) + "\n")


def _data(root: pathlib.Path) -> list:
  """Train on every pair but the held-out ones (SFT on the first sft_examples of them); returns
  the held-out (prompt, answer)s."""
  everything = np.array([(a, b) for a in range(_MAX.value) for b in range(_MAX.value)])
  order = np.random.default_rng(0).permutation(len(everything))
  held_out, train = everything[order[: _EVAL.value]], everything[order[_EVAL.value :]]
  _write_sums(root / "train.jsonl", train)
  _write_sums(root / "sft.jsonl", train[: _SFT_EXAMPLES.value or len(train)])
  _write_sums(root / "prompts.jsonl", train, answers=False)
  return [(f"{a}+{b}=", str(a + b)) for a, b in held_out]


def _sft_config(root: pathlib.Path, steps: int):
  config = config_lib.load_config("tiny")
  config.data.update(dataset="conditional", path=str(root / "sft.jsonl"), vocab_size=0)
  config.data.update(tokenizer="char", seq_len=10)
  config.model.update(num_layers=2, model_dim=64, num_heads=4, mlp_dim=256)
  config.batch_size = 64
  config.optimizer.update(learning_rate=3e-3, warmup_steps=50, ema_decay=0.99)
  config.num_train_steps = steps
  config.eval_every_steps = config.checkpoint_every_steps = config.log_every_steps = steps
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  return config


def _answers(loaded, held_out: list, key, draws: int, **sampler) -> np.ndarray:
  """[prompts, draws] bool: each sampled answer to each held-out prompt right or not."""
  tokenizer, length = loaded.tokenizer, loaded.config.data.seq_len
  prompts = np.zeros((len(held_out), length), np.int32)
  given = np.zeros((len(held_out), length), bool)
  for row, (prompt, _) in enumerate(held_out):
    ids = tokenizer.encode(prompt)
    prompts[row, : len(ids)], given[row, : len(ids)] = ids, True
  prompts, given = np.repeat(prompts, draws, 0), np.repeat(given, draws, 0)
  tokens, _ = md4jax.sample(
    key,
    loaded.denoise_fn,
    batch_size=len(prompts),
    length=length,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    method="confidence",
    prompt=prompts,
    prompt_mask=given,
    eos_id=tokenizer.eos_id,
    **sampler,
  )
  right = []
  for row in range(len(prompts)):
    generated = np.asarray(tokens[row])[~given[row]]
    ends = np.flatnonzero(generated == tokenizer.eos_id)
    text = tokenizer.decode(generated[: ends[0]]) if len(ends) else None
    right.append(text == held_out[row // draws][1])
  return np.asarray(right, np.float64).reshape(len(held_out), draws)


def accuracy(workdir, held_out: list, rollout_steps: int, temperature: float) -> dict:
  """Held-out accuracy ± SE (over prompts): greedy (one call a position), and sampled as the
  rollouts are (rollout_steps confidence steps at temperature, sampled_draws a prompt)."""
  loaded = md4jax.load(workdir)
  length = loaded.config.data.seq_len
  report = {}
  for name, draws, sampler in (
    ("greedy", 1, dict(num_steps=length, temperature=0.0)),
    ("sampled", _SAMPLED_DRAWS.value, dict(num_steps=rollout_steps, temperature=temperature)),
  ):
    per_prompt = _answers(loaded, held_out, jax.random.PRNGKey(0), draws, **sampler).mean(1)
    report[name] = per_prompt.mean()
    report[f"{name}_stderr"] = per_prompt.std(ddof=1) / np.sqrt(len(per_prompt))
  return report


def main(argv):
  del argv
  root = pathlib.Path(_DIR.value)
  if _SKIP_SFT.value:
    record = root / "sft_run.json"
    if not record.is_file():
      raise SystemExit(f"--reuse_sft: no {record}; run once without --reuse_sft.")
    sft_run = json.loads(record.read_text())
    asked = {"examples": _SFT_EXAMPLES.value, "steps": _SFT_STEPS.value, "max_operand": _MAX.value}
    if any(sft_run.get(name) != value for name, value in asked.items()):
      raise SystemExit(
        f"--reuse_sft: {root / 'sft'} was trained with {sft_run}, not the flags' {asked}."
      )
    held_out = _data(root)  # The same split: its seed is fixed.
    sft_seconds = sft_run["seconds"]
    for name in ("grpo", "more_sft"):
      shutil.rmtree(root / name, ignore_errors=True)
  else:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    held_out = _data(root)
    started = time.perf_counter()
    modes.train_and_evaluate(_sft_config(root, _SFT_STEPS.value), root / "sft")
    sft_seconds = time.perf_counter() - started
    sft_run = {
      "seconds": sft_seconds,
      "examples": _SFT_EXAMPLES.value,
      "steps": _SFT_STEPS.value,
      "max_operand": _MAX.value,
    }
    (root / "sft_run.json").write_text(json.dumps(sft_run))
  report = {"sft_steps": _SFT_STEPS.value, "sft_seconds": sft_seconds}
  report["sft_examples"] = _SFT_EXAMPLES.value or "all"
  score = lambda workdir: accuracy(workdir, held_out, ROLLOUT_STEPS, _TEMPERATURE.value)
  report["sft"] = score(root / "sft")

  post = _sft_config(root, _POST_STEPS.value)
  post.update(
    batch_size=_PROMPTS.value, log_every_steps=10, checkpoint_every_steps=_POST_STEPS.value
  )
  post.optimizer.update(
    learning_rate=_LEARNING_RATE.value, warmup_steps=min(5, _POST_STEPS.value - 1), ema_decay=0.0
  )
  post.sample.update(method="confidence", num_steps=ROLLOUT_STEPS, temperature=_TEMPERATURE.value)
  # Every training prompt: exact_match reads an answer only to check a rollout; the verifier
  # computes it from the prompt.
  post.data.path = str(root / ("prompts.jsonl" if _VERIFIER.value else "train.jsonl"))
  reward = "sums_verifier:correct_sum" if _VERIFIER.value else "exact_match"
  if _VERIFIER.value and md4jax.load(root / "sft").tokenizer.alphabet != sums_verifier.ALPHABET:
    raise SystemExit(f"--verifier: the SFT's alphabet is not {sums_verifier.ALPHABET!r}.")
  post.post_train.update(init_from=str(root / "sft"), reward=reward, algorithm="grpo")
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
    grpo_prompts=_PROMPTS.value,
    grpo_group_size=_GROUP.value,
    grpo_likelihood=f"{_LIKELIHOOD.value} x{_DRAWS.value}",
    grpo_temperature=_TEMPERATURE.value,
    grpo_reward=reward,
  )
  report["grpo"] = score(root / "grpo")

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
  report["more_sft"] = score(root / "more_sft")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
