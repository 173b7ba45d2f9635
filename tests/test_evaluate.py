"""Evaluation: determinism, SE ~ 1/√K, the oracle as AR model and as judge, eval.md, plots."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config_lib
from md4jax import data
from md4jax import evaluate
from md4jax import groundtruth
from md4jax import plots
from md4jax import report
from md4jax import train


def tiny_config(**eval_overrides):
  config = config_lib.load_config("tiny")
  for key, value in eval_overrides.items():
    config.eval[key] = value
  return config


def untrained(config):
  mesh = train.make_mesh(jax.devices()[:1])
  model = train.build_model(config)
  state = train.init_state(config, model, train.make_optimizer(config), mesh)
  return mesh, model, state.ema_params


def test_eval_is_deterministic_and_complete():
  config = tiny_config(discrete_steps="10,50")
  mesh, model, params = untrained(config)
  source = data.make_source(config)
  runs = [evaluate.evaluate(config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh)
          for _ in range(2)]
  assert runs[0] == runs[1]
  results = runs[0]
  assert set(results["discrete_time"]) == {"10", "50"}
  assert set(results["estimators"]) == {"standard", "mask_count"}
  # The headline estimator (mask_count) is the same numbers as its row in the table.
  assert results["estimators"]["mask_count"]["bits_per_token"] == results["nelbo_bits_per_token"]
  assert results["perplexity"] == pytest.approx(2 ** results["nelbo_bits_per_token"])


class _RepeatedSource:
  """One sequence, repeated: the spread over rows is the Monte Carlo noise alone."""
  true_bits_per_token = None

  def __init__(self, sequence):
    self.sequence = np.asarray(sequence, np.int32)

  def eval_batches(self, num_sequences, batch_size):
    return [data.dense_batch(np.tile(self.sequence, (batch_size, 1)))
            for _ in range(-(-num_sequences // batch_size))]


def test_stderr_shrinks_like_one_over_sqrt_k():
  stderrs = {}
  for draws in (1, 16):
    config = tiny_config(num_mc_samples=draws, estimator="standard", discrete_steps="",
                         num_sequences=128, batch_size=64)
    mesh, model, params = untrained(config)
    source = _RepeatedSource(data.make_source(config).eval_batches(1, 16)[0]["tokens"][0])
    results = evaluate.evaluate(config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh)
    stderrs[draws] = results["nelbo_bits_per_token_stderr"]
  ratio = stderrs[1] / stderrs[16]
  assert 4 / 1.4 < ratio < 4 * 1.4, stderrs  # √16 = 4; the SE of an SE over 128 rows is ~6%.


class _OracleChain:
  """The ground-truth chain as a causal 'model': logits = log p(x_i | x_{i-1}), BOS -> log π."""

  def __init__(self, language):
    self.log_initial = jnp.log(jnp.asarray(language.initial, jnp.float32))
    self.log_transition = jnp.log(jnp.asarray(language.transition, jnp.float32))
    self.vocab_size = language.vocab_size

  def apply(self, variables, inputs, alpha, segments=None, positions=None):
    del variables, alpha, segments, positions
    previous = self.log_transition[jnp.minimum(inputs, self.vocab_size - 1)]
    return jnp.where((inputs == self.vocab_size)[..., None], self.log_initial, previous)


def test_ar_nll_of_the_oracle_chain_is_the_entropy():
  config = tiny_config(num_sequences=512, batch_size=64)
  config.model.type = "ar"
  mesh = train.make_mesh(jax.devices()[:1])
  source = data.make_source(config)
  oracle = _OracleChain(source.language)
  results = evaluate.evaluate(config, evaluate.make_eval_fn(config, oracle, mesh), {}, source, mesh)
  assert results["estimator"] == "exact_nll" and results["nll_bits_per_token"] == results["nelbo_bits_per_token"]
  # Exactly −log2 p(x) of each row: the paired excess is zero up to float32 rounding.
  assert abs(results["excess_bits_per_token"]) < 1e-4
  assert results["nll_bits_per_token"] == pytest.approx(
      results["true_bits_per_token"], abs=3 * results["nll_bits_per_token_stderr"])
  assert "exact NLL" in report.render(results) and "≤" not in report.render(results)


def test_generative_perplexity_of_exact_samples_is_exp_entropy():
  language = groundtruth.MarkovLanguage(8, seed=3)
  length, n = 16, 2000
  samples = language.sample(jax.random.PRNGKey(0), n, length)
  nats = -np.asarray(language.log_prob(samples), np.float64)
  perplexity, stderr = evaluate.generative_perplexity(nats, np.full(n, length))
  assert perplexity == pytest.approx(math.exp(language.entropy(length) / length), abs=3 * stderr)
  assert 0 < stderr < 0.05 * perplexity


def test_sample_entropy():
  entropy, _ = evaluate.sample_entropy(np.array([[0, 1, 2, 3], [5, 5, 5, 5]]))
  assert entropy == pytest.approx((2.0 + 0.0) / 2)


def test_report_labels_bounds_and_states_the_estimator():
  config = tiny_config(discrete_steps="10")
  mesh, model, params = untrained(config)
  source = data.make_source(config)
  results = evaluate.evaluate(config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh)
  text = report.render({"step": 7, **results})
  assert "# Evaluation at step 7" in text
  assert f"≤ {results['nelbo_bits_per_token']:.4f} ± {results['nelbo_bits_per_token_stderr']:.4f}" in text
  assert "K = 2 Monte Carlo draws" in text and "mask-count estimator" in text
  assert f"{results['true_bits_per_token']:.4f}" in text and "gap to the entropy" in text
  assert "| 10 | ≤ " in text and "t-estimator" in text


def test_plots_write_valid_pngs(tmp_path):
  records = [{"step": s, "loss": 2.0 / s, "nelbo_bits_per_token": 3.0 / s, "grad_norm": 1.0,
              "learning_rate": 1e-3} for s in (5, 10)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  results = {"nelbo_bits_per_token": 2.0, "nelbo_bits_per_token_stderr": 0.1, "true_bits_per_token": 1.9,
             "discrete_time": {"10": {"bits_per_token": 2.3, "stderr": 0.1},
                               "1000": {"bits_per_token": 2.01, "stderr": 0.1}}}
  (tmp_path / "eval.json").write_text(json.dumps(results))
  written = plots.write_all(tmp_path)
  assert sorted(p.name for p in written) == ["nelbo_vs_steps.png", "training_curves.png"]
  for path in written:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
