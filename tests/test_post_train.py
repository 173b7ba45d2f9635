"""--mode=post_train (md4jax.app.post_train): a trained model post-trained with a bigram reward
moves toward the exact KL-regularised optimum π* of the generated language (docs/math.md § 11);
a resumed run continues exactly; a Python reward runs between programs; bad inputs end in one
line with the last good checkpoint kept."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import md4jax
from md4jax import config as config_lib
from md4jax.app import modes, post_train
from md4jax.data import tokenizer as tokenizer_lib
from md4jax.diffusion import optimum
from md4jax.posttraining import preferences
from md4jax.posttraining import rewards as rewards_lib
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, LENGTH = 8, 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A tiny model trained 1000 steps on the generated language (about 0.3 bits/token above its
  entropy), and a bigram reward table."""
  root = tmp_path_factory.mktemp("post_train")
  config = config_lib.load_config("tiny")
  config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 1000
  config.log_every_steps = 1000
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  modes.train_and_evaluate(config, root / "base")
  np.save(root / "reward.npy", np.random.default_rng(0).normal(size=(VOCAB, VOCAB)))
  return root


def _config(base, **overrides):
  config = config_lib.load_config("tiny")
  config.batch_size = 8  # Prompts (groups of post_train.group_size = 8): 64 rollouts a step.
  config.num_train_steps = 4
  config.log_every_steps = 1
  config.checkpoint_every_steps = 2
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 1
  config.optimizer.ema_decay = 0.0
  config.sample.num_samples = 0
  config.sample.num_steps = 16
  config.post_train.init_from = str(base / "base")
  config.post_train.reward = f"bigram:{base / 'reward.npy'}"
  config.post_train.algorithm = "dr_grpo"
  config.post_train.beta = 2.0
  config.post_train.likelihood_draws = 4
  for name, value in overrides.items():
    section, _, key = name.rpartition("__")
    (config[section] if section else config)[key] = value
  return config


@pytest.mark.slow
def test_lora_post_training_moves_only_the_adapters(base, tmp_path):
  """model.lora_rank > 0: fresh adapters beside init_from's kernels, which stay bit for bit."""
  from md4jax.model import lora  # pylint: disable=g-import-not-at-top

  config = _config(base, num_train_steps=2, checkpoint_every_steps=2)
  config.model.lora_rank = 4
  post_train.post_train(config, tmp_path / "lora")
  start, end = md4jax.load(base / "base"), md4jax.load(tmp_path / "lora")
  jax.tree.map(np.testing.assert_array_equal, lora.without_adapters(end.params), start.params)
  flat, _ = jax.tree_util.tree_flatten_with_path(lora.adapters(end.params))
  b_factors = [np.asarray(v) for path, v in flat if lora.LORA_B in jax.tree_util.keystr(path)]
  assert b_factors and any(np.abs(b).max() > 0 for b in b_factors)  # B starts at 0.


def _samples(workdir, rows=2048):
  loaded = md4jax.load(workdir)
  tokens, _ = md4jax.sample(
    jax.random.PRNGKey(1),
    loaded.denoise_fn,
    batch_size=rows,
    length=LENGTH,
    schedule=loaded.schedule,
    mask_id=VOCAB,
    num_steps=LENGTH,
  )
  return np.asarray(tokens), loaded.language


def test_post_training_moves_the_policy_toward_the_exact_optimum(base, tmp_path):
  """Dr. GRPO with a β-KL (β = 2, NELBO with 4 draws): the samples' mean reward and their bigram
  frequencies (a first-order chain fitted to them) move from the base model's toward π*'s."""
  config = _config(
    base,
    num_train_steps=200,
    checkpoint_every_steps=200,
    log_every_steps=50,
    optimizer__warmup_steps=5,
  )
  post_train.post_train(config, tmp_path / "post")
  reward = np.load(base / "reward.npy")
  before, language = _samples(base / "base")
  after, _ = _samples(tmp_path / "post")
  target, _ = optimum.kl_optimum(language, reward, 2.0, LENGTH)

  scores = [reward[x[:, :-1], x[:, 1:]].sum(-1) for x in (before, after)]
  gained = scores[1].mean() - scores[0].mean()
  stderr = np.hypot(*(s.std() / np.sqrt(len(s)) for s in scores))
  best = target.expected_reward(reward)
  assert gained > 8 * stderr and scores[1].mean() < best + 4 * scores[1].std() / np.sqrt(2048)
  # Half the way or more to π*'s reward, and the fitted chain at most 60% as far from π*'s.
  assert scores[1].mean() - scores[0].mean() > 0.5 * (best - scores[0].mean())
  assert optimum.bigram_distance(after, target) < 0.6 * optimum.bigram_distance(before, target)
  records = [json.loads(line) for line in (tmp_path / "post" / "metrics.jsonl").open()]
  assert [r["step"] for r in records] == [50, 100, 150, 200]
  for name in ("reward_mean", "reward_stderr", "kl", "likelihood_variance", "grad_norm"):
    assert all(np.isfinite(r[name]) for r in records), name
  assert (tmp_path / "post" / "plots" / "training_curves.png").is_file()


def test_a_resumed_run_continues_exactly(base, tmp_path):
  """4 steps in one run, or 2, a stop, and a resume from the step-2 checkpoint: the same params
  and the same records."""
  config = _config(base)
  post_train.post_train(config, tmp_path / "whole")
  shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
  resumed = workdir_lib.as_workdir(tmp_path / "resumed")
  shutil.rmtree(resumed.checkpoints / "4")
  post_train.post_train(config, resumed.root)
  whole, again = md4jax.load(tmp_path / "whole"), md4jax.load(resumed.root)
  jax.tree.map(np.testing.assert_array_equal, whole.params, again.params)
  assert (tmp_path / "whole" / "metrics.jsonl").read_text() == resumed.metrics_jsonl.read_text()


@pytest.mark.slow
def test_several_updates_a_rollout_all_train(base, tmp_path):
  """updates_per_rollout = 2: the schedule counts 2 optimizer updates a step, so the last steps
  still move the params (counted in steps, it would reach 0 halfway)."""
  config = _config(base, post_train__updates_per_rollout=2)
  post_train.post_train(config, tmp_path / "twice")
  at = {step: md4jax.load(tmp_path / "twice", step=step, params="raw").params for step in (2, 4)}
  moved = jax.tree.map(
    lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), *at.values()
  )
  assert max(jax.tree.leaves(moved)) > 0
  records = [json.loads(line) for line in (tmp_path / "twice" / "metrics.jsonl").open()]
  assert all(r["learning_rate"] > 0 for r in records[1:])  # Warmup starts at 0.


COUNTER = {"calls": 0}


def count_zeros(rollouts):
  assert rollouts["generated"].all()  # Unprompted: every position generated.
  return (rollouts["tokens"] == 0).sum(-1)


def fails_on_third_call(rollouts):
  COUNTER["calls"] += 1
  if COUNTER["calls"] >= 3:
    raise RuntimeError("the grader is down")
  return (rollouts["tokens"] == 0).sum(-1)


def nan_reward(rollouts):
  return np.full(len(rollouts["tokens"]), np.nan)


@pytest.mark.slow
def test_a_python_reward_runs_between_the_rollout_and_update_programs(base, tmp_path):
  config = _config(base, num_train_steps=2, post_train__reward="test_post_train:count_zeros")
  record = post_train.post_train(config, tmp_path / "python")
  assert 0 <= record["reward_mean"] <= LENGTH and np.isfinite(record["kl"])


def test_a_reward_that_raises_keeps_the_last_good_checkpoint(base, tmp_path):
  COUNTER["calls"] = 0
  config = _config(base, post_train__reward="test_post_train:fails_on_third_call")
  with pytest.raises(rewards_lib.RewardError) as error:
    post_train.post_train(config, tmp_path / "failing")
  message = str(error.value)
  assert "\n" not in message
  assert "'test_post_train:fails_on_third_call' raised RuntimeError: the grader is down" in message
  manager = checkpoint.make_manager(tmp_path / "failing" / "checkpoints", 3)
  assert manager.all_steps() == [2]


@pytest.mark.parametrize(
  "overrides, error, message",
  [
    (
      dict(post_train__reward="test_post_train:nan_reward"),
      rewards_lib.RewardError,
      "returned nan for rollout 0 (64 of 64 not finite)",
    ),
    (dict(post_train__reward="bigram:/nonexistent.npy"), rewards_lib.RewardError, "no file"),
    (dict(post_train__reward="no_such_module:f"), rewards_lib.RewardError, "cannot import"),
    (dict(post_train__init_from=""), ValueError, "post_train.init_from is empty"),
    (dict(post_train__reward="exact_match"), ValueError, "needs data.dataset='conditional'"),
    (dict(post_train__beta=-0.5), ValueError, "post_train.beta must be a finite number >= 0"),
  ],
)
def test_bad_inputs_end_in_one_line(base, tmp_path, overrides, error, message):
  with pytest.raises(error) as raised:
    post_train.post_train(_config(base, **overrides), tmp_path / "bad")
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert not (tmp_path / "bad" / "checkpoints").exists() or not any(
    (tmp_path / "bad" / "checkpoints").iterdir()
  )


def test_init_from_without_a_checkpoint_is_one_line_on_the_command_line(tmp_path):
  (tmp_path / "empty").mkdir()
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "md4jax.main",
      "--config=configs/tiny.py",
      f"--workdir={tmp_path / 'post'}",
      "--mode=post_train",
      f"--config.post_train.init_from={tmp_path / 'empty'}",
      f"--config.post_train.reward=bigram:{tmp_path / 'r.npy'}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.returncode != 0
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "post_train.init_from" in lines[0], result.stderr[-2000:]


def _sums(path, count, seed, high=5):
  rng = np.random.default_rng(seed)
  with open(path, "w") as f:
    for a, b in rng.integers(0, high, size=(count, 2)):
      f.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")


def test_exact_match_rolls_out_each_prompt_and_scores_its_answer(tmp_path):
  """Conditional data: a char model SFT'd on sums, then post-trained with exact_match on prompts
  of fewer digits (whose own char alphabet would number the tokens otherwise): it reads them
  with the SFT's tokenizer and its rollouts score; and exact_match's law on hand-built rollouts
  (right, too long, wrong)."""
  _sums(tmp_path / "sums.jsonl", 400, 0)
  _sums(tmp_path / "small_sums.jsonl", 100, 1, high=3)  # Sums 0..4: no 5, 6, 7 or 8.
  config = config_lib.load_config("tiny")
  config.data.update(dataset="conditional", path=str(tmp_path / "sums.jsonl"), vocab_size=0)
  config.data.update(tokenizer="char", seq_len=8)
  config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 300
  config.log_every_steps = 300
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  modes.train_and_evaluate(config, tmp_path / "sft")
  post = config.copy_and_resolve_references()
  post.update(batch_size=8, num_train_steps=3, log_every_steps=1, checkpoint_every_steps=3)
  post.optimizer.update(warmup_steps=1, ema_decay=0.0)
  post.sample.update(method="confidence", num_steps=4, temperature=1.0)
  post.data.path = str(tmp_path / "small_sums.jsonl")
  post.post_train.update(init_from=str(tmp_path / "sft"), reward="exact_match", group_size=4)
  record = post_train.post_train(post, tmp_path / "post")
  tokenizers = [(tmp_path / run / "tokenizer.json").read_text() for run in ("sft", "post")]
  assert tokenizers[0] == tokenizers[1]
  # The SFT'd model answers many sums (0.375 of step 3's rollouts in the run that set
  # this): a span or an answer misaligned by one position, or renumbered tokens, score 0.
  assert 0.2 < record["reward_mean"] <= 1.0 and "kl" not in record  # β = 0: no KL estimated.

  reward = rewards_lib.parse("exact_match", 0)
  reference = np.array([[1, 2, 3, 4, 9, 0, 0, 0]])  # Prompt 1 2, answer 3 4 and EOS 9, padding.
  answer = np.array([[False, False, True, True, True, False, False, False]])
  rollouts = {"reference": reference, "reference_editable": answer}
  right = dict(rollouts, tokens=reference, generated=answer)
  longer = dict(
    rollouts, tokens=np.array([[1, 2, 3, 4, 5, 9, 9, 9]]), generated=answer | (np.arange(8) == 5)
  )
  wrong = dict(rollouts, tokens=np.array([[1, 2, 3, 5, 9, 9, 9, 9]]), generated=answer)
  assert [float(reward(r)[0]) for r in (right, longer, wrong)] == [1.0, 0.0, 0.0]


def test_a_fresh_run_reads_text_with_init_froms_tokenizer(tmp_path):
  """init_from's char tokenizer is saved into a fresh workdir (again: nothing to do); another
  tokenizer already there, or another kind in data.tokenizer, is one line."""
  source = tmp_path / "sft"
  tokenizer_lib.CharTokenizer("+0123456789=", eos=True).save(source)
  config = config_lib.load_config("tiny")
  config.data.update(dataset="conditional", tokenizer="char")
  key = "post_train.init_from"
  for _ in range(2):
    modes._inherit_tokenizer(config, source, key, workdir_lib.as_workdir(tmp_path / "post"))
  saved = tokenizer_lib.load(tmp_path / "post")
  assert saved.alphabet == "+0123456789=" and saved.eos_id == 12
  tokenizer_lib.CharTokenizer("+0123=", eos=True).save(tmp_path / "stale")
  with pytest.raises(ValueError, match="is not post_train.init_from=.*tokenizer: remove it"):
    modes._inherit_tokenizer(config, source, key, workdir_lib.as_workdir(tmp_path / "stale"))
  config.data.tokenizer = "byte"
  with pytest.raises(ValueError, match="a 'char' tokenizer, not data.tokenizer='byte'"):
    modes._inherit_tokenizer(config, source, key, workdir_lib.as_workdir(tmp_path / "other"))


def _pairs(base, path, count=64, length=LENGTH):
  """Pairs of the language's own sequences: the one of higher bigram reward chosen."""
  reward = np.load(base / "reward.npy")
  language = md4jax.load(base / "base").language
  x = np.asarray(language.sample(jax.random.PRNGKey(3), 2 * count, length)).reshape(count, 2, -1)
  scores = reward[x[..., :-1], x[..., 1:]].sum(-1)
  with open(path, "w") as f:
    for pair, score in zip(x, scores):
      better, worse = pair[np.argmax(score)], pair[np.argmin(score)]
      text = lambda ids: " ".join(map(str, ids))
      f.write(json.dumps({"prompt": "", "chosen": text(better), "rejected": text(worse)}) + "\n")


def test_vrpo_learns_the_preferences_from_a_margin_of_exactly_zero(base, tmp_path):
  """DPO with VRPO's shared draws: at step 1 the policy is the reference and, scored with the
  same times and masks, every margin is exactly 0 (loss log 2); the updates then raise it."""
  _pairs(base, tmp_path / "pairs.jsonl")
  config = _config(
    base,
    num_train_steps=30,
    log_every_steps=1,
    checkpoint_every_steps=30,
    post_train__algorithm="vrpo",
    post_train__pairs=str(tmp_path / "pairs.jsonl"),
    post_train__reward="",
    post_train__beta=0.5,
  )
  post_train.post_train(config, tmp_path / "vrpo")
  records = [json.loads(line) for line in (tmp_path / "vrpo" / "metrics.jsonl").open()]
  assert records[0]["margin"] == 0.0 and records[0]["loss"] == pytest.approx(np.log(2.0))
  late = records[-10:]
  assert np.mean([r["loss"] for r in late]) < np.log(2.0) - 0.05
  assert np.mean([r["preference_accuracy"] for r in late]) > 0.6


@pytest.mark.parametrize(
  "line, message",
  [
    ('{"prompt": "", "chosen": "1 2"}', "missing rejected"),
    ("not json", "not JSON"),
    ('{"prompt": "", "chosen": "1 2", "rejected": 3}', "must be strings"),
  ],
)
def test_a_bad_pairs_file_is_one_line_naming_its_line(base, tmp_path, line, message):
  (tmp_path / "pairs.jsonl").write_text('{"prompt": "", "chosen": "1", "rejected": "2"}\n' + line)
  config = _config(
    base,
    post_train__algorithm="vrpo",
    post_train__pairs=str(tmp_path / "pairs.jsonl"),
    post_train__reward="",
  )
  with pytest.raises(preferences.PairsError) as raised:
    post_train.post_train(config, tmp_path / "bad")
  assert "pairs.jsonl:2: " in str(raised.value) and message in str(raised.value)
  assert "\n" not in str(raised.value)
