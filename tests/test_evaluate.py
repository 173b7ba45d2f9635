"""Evaluation: determinism, SE ~ 1/√K, the oracle as AR model, denoiser and judge, the per-t
profile, bits/byte, eval.md, plots."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from md4jax import config as config_lib
from md4jax.app import plots, report
from md4jax.data import sources
from md4jax.diffusion import groundtruth
from md4jax.evaluation import estimates, evaluate
from md4jax.runtime import sharding
from md4jax.training import state as state_lib


def tiny_config(**eval_overrides):
  config = config_lib.load_config("tiny")
  for key, value in eval_overrides.items():
    config.eval[key] = value
  return config


def untrained(config):
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  model = state_lib.build_model(config)
  state = state_lib.init_state(config, model, state_lib.make_optimizer(config), mesh)
  return mesh, model, state.ema_params


def test_eval_is_deterministic_and_complete():
  config = tiny_config(discrete_steps="10,50")
  mesh, model, params = untrained(config)
  source = sources.make_source(config)
  runs = [
    evaluate.evaluate(config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh)
    for _ in range(2)
  ]
  assert runs[0] == runs[1]
  results = runs[0]
  assert set(results["discrete_time"]) == {"10", "50"}
  assert set(results["estimators"]) == {"standard", "mask_count"}
  # The headline estimator (mask_count) is the same numbers as its row in the table.
  assert results["estimators"]["mask_count"]["bits_per_token"] == results["nelbo_bits_per_token"]
  assert results["perplexity"] == pytest.approx(2 ** results["nelbo_bits_per_token"])


def test_an_order_likelihood_is_reported_beside_an_unchanged_nelbo():
  config = tiny_config(discrete_steps="10", profile_bins=4)
  mesh, model, params = untrained(config)
  source = sources.make_source(config)
  plain = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
  )
  config.eval.likelihood = "orders:4"
  results = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
  )
  added = {key: results.pop(key) for key in set(results) - set(plain)}
  assert results == plain  # The NELBO's rows, draws and figures are untouched.
  assert added["likelihood"] == "orders:4" and added["num_orders"] == 4
  assert added["order_bits_per_token_stderr"] > 0
  assert "order_excess_bits_per_token" in added  # The generated language's law is known.
  # Row by row the bound is at most the mean NLL of its orders, whose mean is the NELBO's.
  assert (
    added["order_minus_nelbo_bits_per_token"] < 4 * added["order_minus_nelbo_bits_per_token_stderr"]
  )
  text = report.render({**results, **added})
  assert "## Likelihood over orders" in text and "| orders:4 (bits/token) | ≤ " in text
  assert "orders:4 likelihood" in evaluate.summary({**results, **added})
  # Periodic evaluations leave it out: K·L calls a row.
  headline = evaluate.make_eval_fn(config, model, mesh, headline_only=True)
  assert "order_bits_per_token" not in evaluate.evaluate(config, headline, params, source, mesh)


def test_the_left_to_right_likelihood_of_the_exact_denoiser_is_the_exact_nll():
  config = tiny_config(discrete_steps="", profile_bins=0, likelihood="order")
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  source = sources.make_source(config)
  oracle = oracles.OracleDenoiser(source.language)
  results = evaluate.evaluate(config, evaluate.make_eval_fn(config, oracle, mesh), {}, source, mesh)
  assert abs(results["order_excess_bits_per_token"]) < 1e-5
  assert results["order_bits_per_token"] == pytest.approx(
    results["nelbo_bits_per_token"] + results["order_minus_nelbo_bits_per_token"], rel=1e-6
  )
  assert "| order (bits/token) | = " in report.render(results)


class _RepeatedSource:
  """One sequence, repeated: the spread over rows is the Monte Carlo noise alone."""

  true_bits_per_token = None

  def __init__(self, sequence):
    self.sequence = np.asarray(sequence, np.int32)

  def eval_batches(self, num_sequences, batch_size):
    return [
      sources.dense_batch(np.tile(self.sequence, (batch_size, 1)))
      for _ in range(-(-num_sequences // batch_size))
    ]

  def text_lengths(self, tokens, editable):
    del tokens, editable  # Markov ids: no text.


def test_stderr_shrinks_like_one_over_sqrt_k():
  stderrs = {}
  for draws in (1, 16):
    # mask_count has bounded variance; the t-estimator's is not (w(t) = 1/t near t = 0), so
    # its sample SE is too heavy-tailed to test a rate on.
    config = tiny_config(
      num_mc_samples=draws,
      estimator="mask_count",
      discrete_steps="",
      profile_bins=0,
      num_sequences=128,
      batch_size=64,
    )
    mesh, model, params = untrained(config)
    source = _RepeatedSource(sources.make_source(config).eval_batches(1, 16)[0]["tokens"][0])
    results = evaluate.evaluate(
      config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
    )
    stderrs[draws] = results["nelbo_bits_per_token_stderr"]
  ratio = stderrs[1] / stderrs[16]
  assert 4 / 1.4 < ratio < 4 * 1.4, stderrs  # √16 = 4; the SE of an SE over 128 rows is ~6%.


def test_discrete_bounds_take_their_own_draws_and_leave_the_headline_alone():
  runs = {}
  for draws in (1, 16):
    # T = 10: the discrete weights are bounded, so the SE of the t-estimator has a rate to test.
    config = tiny_config(
      num_mc_samples=2,
      num_discrete_draws=draws,
      discrete_steps="10",
      profile_bins=0,
      num_sequences=128,
      batch_size=64,
    )
    mesh, model, params = untrained(config)
    source = _RepeatedSource(sources.make_source(config).eval_batches(1, 16)[0]["tokens"][0])
    runs[draws] = evaluate.evaluate(
      config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
    )
  assert runs[1]["nelbo_bits_per_token"] == runs[16]["nelbo_bits_per_token"]
  assert runs[1]["estimators"] == runs[16]["estimators"]
  one, many = runs[1]["discrete_time"]["10"], runs[16]["discrete_time"]["10"]
  ratio = one["stderr"] / many["stderr"]
  assert 4 / 1.4 < ratio < 4 * 1.4, ratio
  # Each is the mean of its own draws (none dropped or zero-padded): the same bound.
  assert abs(one["bits_per_token"] - many["bits_per_token"]) < 4 * math.hypot(
    one["stderr"], many["stderr"]
  )
  assert runs[16]["discrete_time_num_mc_samples"] == 16
  assert "t-estimator (t ~ U(0,1), w(t)·Σ masked CE), K = 16 Monte Carlo draws" in report.render(
    runs[16]
  )


def test_ar_nll_of_the_oracle_chain_is_the_entropy():
  config = tiny_config(num_sequences=512, batch_size=64)
  config.model.type = "ar"
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  source = sources.make_source(config)
  oracle = oracles.OracleChain(source.language)
  results = evaluate.evaluate(config, evaluate.make_eval_fn(config, oracle, mesh), {}, source, mesh)
  assert (
    results["estimator"] == "exact_nll"
    and results["nll_bits_per_token"] == results["nelbo_bits_per_token"]
  )
  # Exactly −log2 p(x) of each row: the paired excess is zero up to float32 rounding.
  assert abs(results["excess_bits_per_token"]) < 1e-4
  assert results["nll_bits_per_token"] == pytest.approx(
    results["true_bits_per_token"], abs=3 * results["nll_bits_per_token_stderr"]
  )
  assert "exact NLL" in report.render(results) and "≤" not in report.render(results)


def test_exact_denoiser_profile_and_side_by_side_with_the_exact_chain():
  config = tiny_config(
    num_sequences=256, batch_size=64, num_mc_samples=1, discrete_steps="", profile_bins=10
  )
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  source = sources.make_source(config)
  oracle = oracles.OracleDenoiser(source.language)
  judge = evaluate.Judge(
    config_lib.load_config("tiny_ar"),
    oracles.OracleChain(source.language),
    {},
    sharding.make_mesh(config),
    workdir="oracle",
  )  # Judge rows over all 8 devices.
  results = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, oracle, mesh), {}, source, mesh, judge
  )
  # The continuous bound is tight for the exact denoiser: paired with the exact NLL of the
  # same rows, the difference is zero and the ratio one, within SE.
  pair = results["side_by_side"]
  assert pair["judge_nll_bits_per_token"] == pytest.approx(
    np.mean(source.true_bits_per_token_of(source.eval_batches(256, 256)[0]["tokens"])), rel=1e-4
  )
  assert abs(pair["difference_bits_per_token"]) < 4 * pair["difference_bits_per_token_stderr"]
  assert (
    pair["difference_bits_per_token_stderr"] < results["nelbo_bits_per_token_stderr"]
  )  # Paired.
  assert pair["ratio"] == pytest.approx(1.0, abs=4 * pair["ratio_stderr"])
  assert "## Side by side with the AR judge" in report.render(results)
  profile = results["loss_profile"]
  assert (
    len(profile["bits_per_token"]) == 10
    and profile["t_edges"][0] == 0
    and profile["t_edges"][-1] == 1
  )
  # With the exact denoiser the continuous bound is tight: the mean over bins is the entropy.
  assert profile["mean_bits_per_token"] == pytest.approx(
    results["true_bits_per_token"], abs=4 * profile["mean_stderr"]
  )
  # Linear schedule: bin value = E[CE per masked token at t], which grows as context is masked.
  first, last = profile["bits_per_token"][0], profile["bits_per_token"][-1]
  assert last - first > 4 * math.hypot(profile["stderr"][0], profile["stderr"][-1])
  assert "## Per-t loss profile" in report.render(results)


class _AlphaRecorder:
  """A uniform 'denoiser' that records the α(t) it is called with."""

  def __init__(self, vocab_size):
    self.vocab_size, self.alphas = vocab_size, []

  def apply(self, variables, z_t, alpha, segments=None, positions=None):
    del variables, segments, positions
    jax.debug.callback(lambda a: self.alphas.append(np.asarray(a)), alpha, ordered=True)
    return jnp.zeros(z_t.shape + (self.vocab_size,))


def test_profile_draws_t_inside_each_bin():
  config = tiny_config(profile_bins=5)
  recorder = _AlphaRecorder(config.data.vocab_size)
  batch = sources.make_source(config).eval_batches(64, 64)[0]
  nats = evaluate.profile_nats({}, batch, jax.random.PRNGKey(0), model=recorder, config=config)
  assert nats.shape == (64, 5)
  assert len(recorder.alphas) == 5
  for b, alpha in enumerate(recorder.alphas):  # Linear: t = 1 − α.
    t = 1.0 - alpha
    assert np.all((t > b / 5 - 1e-6) & (t <= (b + 1) / 5 + 1e-6)), (b, t.min(), t.max())
    assert t.max() - t.min() > 0.1  # Spread over the bin, not one point.
  # Uniform logits: w(t)·Σ masked CE = (masked / t)·log V, whose mean is L·log V in every bin
  # (bin 0, near t = 0, is too heavy-tailed to check on 64 rows).
  means = np.asarray(nats)[:, 1:].mean(axis=0)
  np.testing.assert_allclose(means, 16 * np.log(8), rtol=0.2)


@pytest.mark.slow
def test_profile_mean_agrees_with_the_t_estimator():
  config = tiny_config(num_sequences=128, batch_size=64, num_mc_samples=4, profile_bins=16)
  mesh, model, params = untrained(config)
  results = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, sources.make_source(config), mesh
  )
  profile, standard = results["loss_profile"], results["estimators"]["standard"]
  assert profile["mean_bits_per_token"] == pytest.approx(
    standard["bits_per_token"], abs=4 * math.hypot(profile["mean_stderr"], standard["stderr"])
  )
  config = tiny_config(profile_bins=0)
  mesh, model, params = untrained(config)
  off = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, sources.make_source(config), mesh
  )
  assert "loss_profile" not in off and "Per-t" not in report.render(off)


def test_bits_per_byte_counts_utf8_bytes(tmp_path):
  rng = np.random.default_rng(0)
  words = ["café", "naïve", "über", "déjà", "vu", "ünd", "mañana", "plain"]
  text = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(200))
  (tmp_path / "corpus.txt").write_text(text)
  config = tiny_config(num_sequences=16, discrete_steps="", profile_bins=0)
  config.data.dataset, config.data.path = "localtext", str(tmp_path / "corpus.txt")
  config.data.tokenizer, config.data.packing = "char", "concat"
  config.data.vocab_size = (
    len(set(text) - {"\n"}) + 1
  )  # Its characters (lines are documents) and EOS.
  source = sources.make_source(config, str(tmp_path / "work"))
  mesh, model, params = untrained(config)
  results = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
  )
  # The scored rows' own text, counted independently: EOS reads as a line break.
  rows = np.concatenate(
    [
      b["tokens"][b["editable"].astype(bool)]
      for b in source.eval_batches(16, config.eval.batch_size)
    ]
  )
  row_text = "".join(
    source.tokenizer.alphabet[i] if i < len(source.tokenizer.alphabet) else "\n" for i in rows
  )
  assert (
    results["num_bytes"]
    == len(row_text.encode("utf-8"))
    > results["num_characters"]
    == len(row_text)
  )
  assert results["bits_per_byte"] * results["num_bytes"] == pytest.approx(
    results["bits_per_character"] * results["num_characters"]
  )
  assert "bits/byte" in report.render(results)


def test_judge_must_model_the_same_data():
  config = tiny_config()
  source = sources.make_source(config)
  judge_config = config_lib.load_config("tiny_ar")
  judge_config.data.language_seed = 1
  judge = evaluate.Judge(
    judge_config,
    oracles.OracleChain(source.language),
    {},
    sharding.make_mesh(config, jax.devices()[:1]),
    workdir="other",
  )
  with pytest.raises(ValueError, match="data.language_seed=1"):
    judge.check_compatible(config, config.data.seq_len)


def test_generative_perplexity_of_exact_samples_is_exp_entropy():
  language = groundtruth.MarkovLanguage(8, seed=3)
  length, n = 16, 2000
  samples = language.sample(jax.random.PRNGKey(0), n, length)
  nats = -np.asarray(language.log_prob(samples), np.float64)
  perplexity, stderr = estimates.generative_perplexity(nats, np.full(n, length))
  assert perplexity == pytest.approx(math.exp(language.entropy(length) / length), abs=3 * stderr)
  assert 0 < stderr < 0.05 * perplexity


def test_sample_entropy():
  entropy, _ = estimates.sample_entropy(np.array([[0, 1, 2, 3], [5, 5, 5, 5]]))
  assert entropy == pytest.approx((2.0 + 0.0) / 2)


def test_report_labels_bounds_and_states_the_estimator():
  config = tiny_config(discrete_steps="10")
  mesh, model, params = untrained(config)
  source = sources.make_source(config)
  results = evaluate.evaluate(
    config, evaluate.make_eval_fn(config, model, mesh), params, source, mesh
  )
  text = report.render({"step": 7, **results})
  assert "# Evaluation at step 7" in text
  assert (
    f"≤ {results['nelbo_bits_per_token']:.4f} ± {results['nelbo_bits_per_token_stderr']:.4f}"
    in text
  )
  assert "K = 2 Monte Carlo draws" in text and "mask-count estimator" in text
  assert f"{results['true_bits_per_token']:.4f}" in text and "gap to the entropy" in text
  assert "| 10 | ≤ " in text and "t-estimator" in text


def test_plots_write_valid_pngs(tmp_path):
  records = [
    {
      "step": s,
      "loss": 2.0 / s,
      "nelbo_bits_per_token": 3.0 / s,
      "grad_norm": 1.0,
      "learning_rate": 1e-3,
    }
    for s in (5, 10)
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  results = {
    "nelbo_bits_per_token": 2.0,
    "nelbo_bits_per_token_stderr": 0.1,
    "true_bits_per_token": 1.9,
    "discrete_time": {
      "10": {"bits_per_token": 2.3, "stderr": 0.1},
      "1000": {"bits_per_token": 2.01, "stderr": 0.1},
    },
  }
  (tmp_path / "eval.json").write_text(json.dumps(results))
  written = plots.write_all(tmp_path)
  assert sorted(p.name for p in written) == ["nelbo_vs_steps.png", "training_curves.png"]
  for path in written:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
