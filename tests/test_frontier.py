"""The frontier sweep: exact samples of the oracle score exp(entropy); cooling trades entropy away."""

import json
import math

import numpy as np
import oracles
import pytest

from md4jax import config as config_lib
from md4jax.app import frontier
from md4jax.data import sources
from md4jax.evaluation import evaluate
from md4jax.runtime import sharding


def oracle_setup(model_type="mdm", **frontier_overrides):
  config = config_lib.load_config("tiny")
  config.model.type = model_type
  config.frontier.methods, config.frontier.num_steps = "first_hitting", "16"
  config.frontier.temperatures, config.frontier.num_samples = "0.5,1.0", 256
  for key, value in frontier_overrides.items():
    config.frontier[key] = value
  config_lib.validate_config(config, num_devices=1)
  source = sources.make_source(config)
  judge_config = config_lib.load_config("tiny_ar")
  judge = evaluate.Judge(
    judge_config,
    oracles.OracleChain(source.language),
    {},
    sharding.make_mesh(config),
    workdir="oracle",
  )
  return config, source, judge


def test_sweep_settings():
  config = config_lib.load_config("tiny")
  config.frontier.methods, config.frontier.num_steps, config.frontier.temperatures = (
    "ancestral,cached",
    "4,8",
    "1",
  )
  settings = frontier.sweep_settings(config)
  assert [(s["method"], s["num_steps"]) for s in settings] == [
    ("ancestral", 4),
    ("ancestral", 8),
    ("cached", 4),
    ("cached", 8),
  ]
  config.model.type = "ar"
  config.frontier.temperatures = "0.9, 1.1"
  assert frontier.sweep_settings(config) == [
    {"method": "ar", "num_steps": None, "threshold": None, "temperature": 0.9},
    {"method": "ar", "num_steps": None, "threshold": None, "temperature": 1.1},
  ]
  config.model.type = "mdm"
  config.frontier.methods, config.frontier.thresholds, config.frontier.temperatures = (
    "first_hitting,threshold",
    "0.5,0.9",
    "1",
  )
  assert [
    (s["method"], s["num_steps"], s["threshold"]) for s in frontier.sweep_settings(config)
  ] == [("first_hitting", None, None), ("threshold", None, 0.5), ("threshold", None, 0.9)]


def test_exact_samples_reach_the_entropy_and_cooling_lowers_it(tmp_path):
  config, source, judge = oracle_setup()
  # first_hitting with the exact denoiser reveals one token at a time from its exact
  # conditional: the samples are exact draws of the language.
  results = frontier.run(config, oracles.OracleDenoiser(source.language), {}, source, judge)
  cold, exact = results["points"]
  assert (cold["temperature"], exact["temperature"]) == (0.5, 1.0)
  truth = 2**source.true_bits_per_token
  assert exact["generative_perplexity"] == pytest.approx(
    truth, abs=3 * exact["generative_perplexity_stderr"]
  )
  # The judge is the true chain: its perplexity is the exact one.
  assert exact["generative_perplexity"] == pytest.approx(exact["true_perplexity"], rel=1e-4)
  # Equal-length rows: the judge's ratio SE and the true law's delta-method SE are one quantity.
  assert exact["generative_perplexity_stderr"] == pytest.approx(
    exact["true_perplexity_stderr"], rel=1e-3
  )
  # Held-out rows are exact draws too: the same point within SE.
  reference = results["data"]
  assert reference["num_rows"] == 256
  for name in ("generative_perplexity", "sample_entropy"):
    slack = 4 * math.hypot(exact[f"{name}_stderr"], reference[f"{name}_stderr"])
    assert exact[name] == pytest.approx(reference[name], abs=slack)
  # Temperature 0.5 buys a lower perplexity with lower entropy: not better samples.
  for name in ("generative_perplexity", "sample_entropy"):
    assert cold[name] < exact[name] - 3 * math.hypot(
      cold[f"{name}_stderr"], exact[f"{name}_stderr"]
    )
  assert exact["nfe"] == 16 and results["judge_workdir"] == "oracle"

  json_path, png_path = frontier.write(tmp_path, results)
  assert json.loads(json_path.read_text()) == json.loads(json.dumps(results))
  assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 1000


def test_ar_sweep_with_the_oracle_chain():
  config, source, judge = oracle_setup("ar", temperatures="1.0", num_samples=256)
  results = frontier.run(config, oracles.OracleChain(source.language), {}, source, judge)
  [point] = results["points"]
  assert point["method"] == "ar" and point["nfe"] == config.data.seq_len
  truth = 2**source.true_bits_per_token
  assert point["generative_perplexity"] == pytest.approx(
    truth, abs=3 * point["generative_perplexity_stderr"]
  )


def test_without_judge_scores_by_the_true_law_or_fails():
  config, source, _ = oracle_setup(temperatures="1.0", num_samples=64)
  results = frontier.run(config, oracles.OracleDenoiser(source.language), {}, source)
  [point] = results["points"]
  assert "generative_perplexity" not in point and point["true_perplexity"] > 1
  assert results["judge_workdir"] is None

  class UnknownLaw:
    true_bits_per_token = None

  with pytest.raises(ValueError, match="eval.judge_workdir"):
    frontier.run(config, oracles.OracleDenoiser(source.language), {}, UnknownLaw())
  config.sample.prompt = "1 2"
  with pytest.raises(ValueError, match="unset sample.prompt"):
    frontier.run(config, oracles.OracleDenoiser(source.language), {}, source)


def test_judge_rejects_other_vocabularies():
  config, _, judge = oracle_setup()
  config.data.vocab_size = 9
  with pytest.raises(ValueError, match="vocab_size 8 differs"):
    judge.check_compatible(config, 16)
  config.data.vocab_size = 8
  with pytest.raises(ValueError, match=r"The samples are 17 tokens long, past the judge's context"):
    judge.check_compatible(config, 17)


def test_judge_scores_rows_exactly_over_the_mesh_and_skips_the_prompt():
  _, source, judge = oracle_setup()
  language = source.language
  # 3 rows on 8 devices: padded to 8, the padding dropped.
  tokens = np.array([[0] * 16, [1] * 16, [0, 1] * 8], np.int32)
  log_p = np.asarray(language.log_prob(tokens), np.float64)
  np.testing.assert_allclose(judge.nats(sources.dense_batch(tokens)), -log_p, rtol=1e-5)
  perplexity = judge.score(tokens)["generative_perplexity"]
  assert perplexity == pytest.approx(math.exp(-log_p.sum() / tokens.size), rel=1e-5)
  # With a 4-token prompt only the 12 tokens after it count: −log p(x_4: | x_:4).
  prompt_nats = -np.asarray(language.log_prob(tokens[:, :4]), np.float64)
  scored = judge.score(tokens, prompt_length=4)
  assert scored["generative_perplexity"] == pytest.approx(
    math.exp((-log_p - prompt_nats).sum() / (3 * 12)), rel=1e-5
  )
  assert scored["sample_entropy"] == pytest.approx(np.mean([0.0, 0.0, 1.0]))  # Over the 12 tokens.
