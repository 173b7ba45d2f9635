"""The workdir modes in process: NaN stop keeps the last good checkpoint, AR and conditional runs end to end."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib


def load_config(name):
  config = config_lib.load_config(name)
  config.lock()
  return config


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  config = load_config("tiny")
  config.num_train_steps, config.checkpoint_every_steps, config.log_every_steps = 20, 5, 10
  # From step 7 on the learning rate is NaN, so the params and then the loss become NaN.
  monkeypatch.setattr(
    state_lib,
    "learning_rate_schedule",
    lambda config, updates_per_step=1: lambda count: jnp.where(count >= 7, jnp.nan, 1e-3),
  )
  with pytest.raises(
    FloatingPointError, match=r"Loss is nan at step (8|9).*checkpoint \(step 5\) is kept"
  ):
    modes.train_and_evaluate(config, tmp_path)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(tmp_path).checkpoints, max_to_keep=3)
  assert manager.all_steps() == [5]
  abstract = state_lib.abstract_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config),
  )
  restored = checkpoint.restore(manager, abstract)
  assert restored.data_state == {"next_batch_index": 5} and int(restored.state.step) == 5
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(restored.state.params))


def test_train_ar_end_to_end_in_process(tmp_path):
  config = load_config("tiny_ar")
  results = modes.train_and_evaluate(config, tmp_path)
  saved = json.loads((tmp_path / "eval.json").read_text())
  assert (
    saved["nll_bits_per_token"]
    == saved["nelbo_bits_per_token"]
    == pytest.approx(results["nelbo_bits_per_token"])
  )
  assert saved["estimator"] == "exact_nll" and saved["step"] == config.num_train_steps
  # Trained for 20 steps: better than uniform, no better than the truth (minus noise).
  assert saved["true_bits_per_token"] - 0.1 < saved["nll_bits_per_token"] < math.log2(8)
  records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert len(records) == config.sample.num_samples
  assert all(len(r["tokens"]) == config.data.seq_len for r in records)


@pytest.mark.slow
def test_train_conditional_end_to_end_in_process(tmp_path):
  # Responses spell their prompt backwards: only the response tokens are trained and scored.
  rng = np.random.default_rng(0)
  prompts = ["".join(rng.choice(list("abcdef"), rng.integers(1, 8))) for _ in range(48)]
  for split, chunk in (("train", prompts[:40]), ("validation", prompts[40:])):
    (tmp_path / "data" / split).mkdir(parents=True)
    (tmp_path / "data" / split / "pairs.jsonl").write_text(
      "\n".join(json.dumps({"prompt": p, "response": p[::-1]}) for p in chunk)
    )
  config = load_config("tiny")
  config.data.dataset, config.data.path = "conditional", str(tmp_path / "data")
  config.data.tokenizer, config.data.vocab_size = "byte", 0  # 0: the tokenizer's size.
  results = modes.train_and_evaluate(config, tmp_path / "work")
  # The run took the tokenizer's 257 ids (256 bytes and EOS) and recorded them.
  written = json.loads((tmp_path / "work" / "config.json").read_text())
  assert written["data"]["vocab_size"] == 257
  saved = json.loads((tmp_path / "work" / "eval.json").read_text())
  assert saved["nelbo_bits_per_token"] == pytest.approx(results["nelbo_bits_per_token"])
  # Scored tokens: each validation response and its EOS, never a prompt.
  assert saved["num_sequences"] == 8
  assert saved["num_tokens"] == sum(len(p) + 1 for p in prompts[40:])
  assert 0 < saved["nelbo_bits_per_token"] < 3 * math.log2(257)
