"""Trainer: golden loss, 8 devices == 1 device, optimizer masks, NaN stop, AR loss, eval/sample, conditional data."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import checkpoint
from md4jax import config_lib
from md4jax import data
from md4jax import evaluate
from md4jax import generate
from md4jax import train


# Loss of the first step of configs/tiny.py on one device. It changes only when the
# model, the objective, the data or the initialization change on purpose: update it then.
GOLDEN_TINY_FIRST_LOSS = 2.363302230834961


def load_config(name):
  config = config_lib.load_config(name)
  config.lock()
  return config


def first_steps(config, devices, num_steps=1):
  """Runs num_steps train steps on a mesh over `devices`; returns (state, [metrics])."""
  mesh = train.make_mesh(devices)
  model, optimizer = train.build_model(config), train.make_optimizer(config)
  state = train.init_state(config, model, optimizer, mesh)
  step_fn = train.make_train_step(config, model, optimizer, mesh, state)
  iterator = data.make_source(config).train_iterator()
  history = []
  for _ in range(num_steps):
    state, metrics = step_fn(state, evaluate.device_batch(next(iterator), mesh))
    history.append(jax.device_get(metrics))
  return state, history


def test_golden_loss_after_one_step():
  _, [metrics] = first_steps(load_config("tiny"), jax.devices()[:1])
  np.testing.assert_allclose(
      metrics["loss"], GOLDEN_TINY_FIRST_LOSS, rtol=1e-5,
      err_msg="The first-step loss of configs/tiny.py changed. It changes only on purpose "
              "(model, objective, data or init); if so, update GOLDEN_TINY_FIRST_LOSS.")
  np.testing.assert_allclose(metrics["nelbo_bits_per_token"], metrics["loss"] / math.log(2), rtol=1e-6)


def test_eight_devices_match_one_device():
  assert len(jax.devices()) == 8, "tests/conftest.py should provide 8 CPU devices"
  config = load_config("tiny")
  state_1, metrics_1 = first_steps(config, jax.devices()[:1], num_steps=2)
  state_8, metrics_8 = first_steps(config, jax.devices(), num_steps=2)
  assert len(state_8.params["embed"]["embedding"].sharding.device_set) == 8
  for m1, m8 in zip(metrics_1, metrics_8):
    for name in m1:
      np.testing.assert_allclose(m8[name], m1[name], rtol=1e-5, err_msg=name)
  for tree_1, tree_8 in ((state_1.params, state_8.params), (state_1.ema_params, state_8.ema_params)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), tree_1, tree_8)


def test_weight_decay_skips_norms_and_vectors():
  config = load_config("tiny")
  params = train.build_model(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
                                          jnp.ones((1,)))["params"]
  mask = train.weight_decay_mask(params)
  assert mask["block_0"]["attn"]["qkv"]["kernel"] and mask["embed"]["embedding"]
  assert not mask["final_norm"]["scale"] and not mask["block_0"]["attn_norm"]["scale"]


def test_learning_rate_warms_up_then_decays_to_zero():
  config = load_config("tiny")
  schedule = train.learning_rate_schedule(config)
  peak, warmup = config.optimizer.learning_rate, config.optimizer.warmup_steps
  assert schedule(0) == 0.0
  np.testing.assert_allclose(schedule(warmup), peak, rtol=1e-6)
  np.testing.assert_allclose(schedule(config.num_train_steps), 0.0, atol=1e-9)


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_loss_starts_near_uniform(name):
  # Small-init logits are near uniform, so the per-token loss starts near ln V. The
  # mask_count estimator makes the diffusion loss's one-batch estimate precise enough.
  config = load_config(name)
  config.training.estimator = "mask_count"
  _, [metrics] = first_steps(config, jax.devices()[:1])
  assert abs(metrics["loss"] - math.log(config.data.vocab_size)) < 0.05, metrics["loss"]


def test_ar_inputs_shift_right_with_bos():
  tokens = jnp.array([[3, 1, 4, 1]])
  np.testing.assert_array_equal(generate.ar_inputs(tokens, bos_id=8), [[8, 3, 1, 4]])


def test_ar_sample_is_causal_and_in_vocab():
  config = load_config("tiny_ar")
  mesh = train.make_mesh(jax.devices()[:1])
  model, optimizer = train.build_model(config), train.make_optimizer(config)
  state = train.init_state(config, model, optimizer, mesh)
  source = data.make_source(config)
  tokens, nfe, _, _ = generate.generate(config, model, state.params, source, jax.random.PRNGKey(0))
  assert nfe == config.data.seq_len
  assert tokens.shape == (config.sample.num_samples, config.data.seq_len)
  assert tokens.min() >= 0 and tokens.max() < config.data.vocab_size
  greedy = config.copy_and_resolve_references()
  greedy.sample.temperature = 0.0
  sequence = generate.generate(greedy, model, state.params, source, jax.random.PRNGKey(1))[0][0]
  # Greedy decoding: each token is the argmax of the model given the tokens before it.
  logits = model.apply({"params": state.params},
                       generate.ar_inputs(sequence[None], config.data.vocab_size))[0]
  np.testing.assert_array_equal(jnp.argmax(logits, -1), sequence)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  config = load_config("tiny")
  config.num_train_steps, config.checkpoint_every_steps, config.log_every_steps = 20, 5, 10
  # From step 7 on the learning rate is NaN, so the params and then the loss become NaN.
  monkeypatch.setattr(train, "learning_rate_schedule",
                      lambda config: lambda count: jnp.where(count >= 7, jnp.nan, 1e-3))
  with pytest.raises(FloatingPointError, match=r"Loss is nan at step (8|9).*checkpoint \(step 5\) is kept"):
    train.train_and_evaluate(config, tmp_path)
  manager = checkpoint.make_manager(tmp_path, max_to_keep=3)
  assert manager.all_steps() == [5]
  mesh = train.make_mesh()
  state = train.init_state(config, train.build_model(config), train.make_optimizer(config), mesh)
  _, restored, data_state = checkpoint.restore(manager, checkpoint.abstract_like(state))
  assert data_state == {"next_batch_index": 5} and int(restored.step) == 5
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(restored.params))


def test_train_ar_end_to_end_in_process(tmp_path):
  config = load_config("tiny_ar")
  results = train.train_and_evaluate(config, tmp_path)
  saved = json.loads((tmp_path / "eval.json").read_text())
  assert saved["nll_bits_per_token"] == saved["nelbo_bits_per_token"] == pytest.approx(
      results["nelbo_bits_per_token"])
  assert saved["estimator"] == "exact_nll" and saved["step"] == config.num_train_steps
  # Trained for 20 steps: better than uniform, no better than the truth (minus noise).
  assert saved["true_bits_per_token"] - 0.1 < saved["nll_bits_per_token"] < math.log2(8)
  records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert len(records) == config.sample.num_samples
  assert all(len(r["tokens"]) == config.data.seq_len for r in records)


def test_train_conditional_end_to_end_in_process(tmp_path):
  # Responses spell their prompt backwards: only the response tokens are trained and scored.
  rng = np.random.default_rng(0)
  prompts = ["".join(rng.choice(list("abcdef"), rng.integers(1, 8))) for _ in range(48)]
  for split, chunk in (("train", prompts[:40]), ("validation", prompts[40:])):
    (tmp_path / "data" / split).mkdir(parents=True)
    (tmp_path / "data" / split / "pairs.jsonl").write_text("\n".join(
        json.dumps({"prompt": p, "response": p[::-1]}) for p in chunk))
  config = load_config("tiny")
  config.data.dataset, config.data.path = "conditional", str(tmp_path / "data")
  config.data.tokenizer, config.data.vocab_size = "byte", 257  # 256 bytes and EOS.
  results = train.train_and_evaluate(config, tmp_path / "work")
  saved = json.loads((tmp_path / "work" / "eval.json").read_text())
  assert saved["nelbo_bits_per_token"] == pytest.approx(results["nelbo_bits_per_token"])
  # Scored tokens: each validation response and its EOS, never a prompt.
  assert saved["num_sequences"] == 8
  assert saved["num_tokens"] == sum(len(p) + 1 for p in prompts[40:])
  assert 0 < saved["nelbo_bits_per_token"] < 3 * math.log2(257)
