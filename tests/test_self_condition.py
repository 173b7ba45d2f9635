"""Self-conditioning (model.self_condition) on the exact oracle.

The oracle `ReadsItsEstimate` is the exact posterior when it reads an estimate of x_0 and the
same log-probabilities halved (a flatter, worse model) when it reads none, so each path shows
whether the estimate reached it: the bound of the two-pass denoiser is the exact one, the uniform
sampler (and a masked one, with passes=1) that passes each step's estimate to the next draws the
chain, and one that dropped it would draw the flatter law.
"""

import dataclasses
import itertools
import json
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import md4jax
from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.diffusion import bounds, groundtruth, schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer
from md4jax.training import objective

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, LENGTH = 3, 4


@dataclasses.dataclass(frozen=True)
class ReadsItsEstimate:
  """apply_fn(params, z, time, previous=None) of a self-conditioned oracle (module docstring)."""

  exact: Callable
  self_condition: bool = True

  def __call__(self, params, z, time, previous=None):
    del params
    log_probs = jax.nn.log_softmax(self.exact(z, time).astype(jnp.float32), axis=-1)
    read = 0.0 if previous is None else previous.sum(-1, keepdims=True)  # 1 per estimate, 0 none.
    return log_probs * (0.5 + 0.5 * read)


@pytest.fixture(scope="module")
def chain():
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  every = np.array(list(itertools.product(range(VOCAB), repeat=LENGTH)), np.int32)
  true_law = np.exp(np.asarray(language.log_prob(jnp.asarray(every)), np.float64))
  return language, true_law


def _gap_to_nll(language, denoise_fn, process, n=6000, length=10):
  """NELBO − exact NLL per sequence [n] (the same sequences, times and noise for any denoiser)."""
  x = language.sample(jax.random.PRNGKey(0), n, length)
  nll = -np.asarray(language.log_prob(x), np.float64)
  kwargs = {"mask_id": VOCAB} if process == "masked" else {}
  nats = jax.jit(
    lambda key, denoiser: bounds.nelbo(
      key, denoiser, x, schedules.get_schedule("linear"), process=process, **kwargs
    )
  )(jax.random.PRNGKey(1), denoise_fn)
  return np.asarray(nats, np.float64) - nll


def _mean_and_se(values):
  return values.mean(), values.std(ddof=1) / np.sqrt(values.size)


@pytest.mark.parametrize("process", ["masked", "uniform"])
def test_the_bound_reads_the_first_pass_estimate(chain, process):
  """Two passes (the bound's model): unbiased for the exact NLL (4 SE); one pass reading no
  estimate, on the same draws: the flatter model, far above it."""
  language, _ = chain
  exact = language.denoise_fn(VOCAB) if process == "masked" else language.uniform_denoise_fn()
  oracle = ReadsItsEstimate(exact)
  gap = _gap_to_nll(language, Denoiser(oracle, passes=2), process)
  mean, se = _mean_and_se(gap)
  assert abs(mean) < 4 * se, (mean, se)
  flat_mean, flat_se = _mean_and_se(
    _gap_to_nll(language, Denoiser(oracle, passes=1), process) - gap
  )
  assert flat_mean > 10 * flat_se and flat_mean > 0.1, (flat_mean, flat_se)


def _counts(tokens):
  index = (np.asarray(tokens) * VOCAB ** np.arange(LENGTH - 1, -1, -1)).sum(-1)
  return np.bincount(index, minlength=VOCAB**LENGTH)


def _chi_square_p(counts, law):
  expected = law * counts.sum()
  keep = expected >= 5.0
  merged_counts = np.append(counts[keep], counts[~keep].sum())
  merged_expected = np.append(expected[keep], expected[~keep].sum())
  statistic = np.sum((merged_counts - merged_expected) ** 2 / merged_expected)
  return stats.chi2.sf(statistic, len(merged_counts) - 1)


def test_the_uniform_sampler_passes_each_steps_estimate_to_the_next(chain):
  """With passes=1 the oracle is exact only where the sampler hands it the last call's estimate:
  from the second step on (the first reads none at α(s) = 1/512, a negligible error), so the
  draws are the chain's; the same oracle never handed one draws the flatter law."""
  language, true_law = chain
  oracle = Denoiser(ReadsItsEstimate(language.uniform_denoise_fn()), passes=1)

  def draw(denoise_fn, num_steps):
    return md4jax.sample(
      jax.random.PRNGKey(2),
      denoise_fn,
      batch_size=10000,
      length=LENGTH,
      schedule="linear",
      num_steps=num_steps,
      process="uniform",
    )

  tokens, info = draw(oracle, 512)
  assert int(info["nfe"]) == 512  # One call per step.
  assert _chi_square_p(_counts(tokens), true_law) > 1e-4
  never_handed = lambda z, alpha: oracle(z, alpha)  # A plain function: no estimate to hand.
  flat_tokens, _ = draw(never_handed, 64)
  assert _chi_square_p(_counts(flat_tokens), true_law) < 1e-6


def test_masked_samplers_read_the_estimate_of_the_same_state_in_two_calls(chain):
  """first_hitting is exact with the exact posterior; the two-pass denoiser is that posterior,
  and each of its L calls is two network calls."""
  language, true_law = chain
  tokens, info = md4jax.sample(
    jax.random.PRNGKey(3),
    Denoiser(ReadsItsEstimate(language.denoise_fn(VOCAB)), passes=2),
    batch_size=10000,
    length=LENGTH,
    mask_id=VOCAB,
    schedule=schedules.get_schedule("linear"),
    method="first_hitting",
  )
  assert int(info["nfe"]) == 2 * LENGTH
  assert _chi_square_p(_counts(tokens), true_law) > 1e-4


def test_masked_samplers_with_one_pass_hand_each_calls_estimate_to_the_next(chain):
  """passes=1: one call a step, each reading the last call's estimate (none at the first, whose
  reveals at T = 512 are rare). The oracle is exact only where it reads one, so the draws are the
  chain's; the same oracle never handed one draws the flatter law."""
  language, true_law = chain
  oracle = Denoiser(ReadsItsEstimate(language.denoise_fn(VOCAB)), passes=1)

  def draw(denoise_fn, num_steps):
    return md4jax.sample(
      jax.random.PRNGKey(4),
      denoise_fn,
      batch_size=10000,
      length=LENGTH,
      mask_id=VOCAB,
      schedule=schedules.get_schedule("linear"),
      method="ancestral",
      num_steps=num_steps,
    )

  tokens, info = draw(oracle, 512)
  assert int(info["nfe"]) == 512 and "sampler_calls" not in info  # One call a step.
  assert _chi_square_p(_counts(tokens), true_law) > 1e-4
  never_handed = lambda z, alpha: oracle(z, alpha)  # A plain function: no estimate to hand.
  flat_tokens, _ = draw(never_handed, 64)
  assert _chi_square_p(_counts(flat_tokens), true_law) < 1e-6


@pytest.mark.parametrize("kwargs", [dict(guidance_scale=1.0, prompt=[1]), dict(block_size=2)])
def test_one_pass_hands_estimates_within_one_block_without_guidance(chain, kwargs):
  language, _ = chain
  oracle = Denoiser(ReadsItsEstimate(language.denoise_fn(VOCAB)), passes=1)
  with pytest.raises(ValueError, match="passes=1 hands each call's estimate"):
    md4jax.sample(
      jax.random.PRNGKey(0),
      oracle,
      batch_size=2,
      length=LENGTH,
      mask_id=VOCAB,
      schedule=schedules.get_schedule("linear"),
      num_steps=4,
      **kwargs,
    )


def test_training_reads_a_stop_gradient_estimate_on_half_the_steps():
  """objective's training denoiser: one coin per step; the first pass carries no gradient."""
  z = jnp.array([[0, 1, 2]])

  def call(w, previous):
    logits = w * jax.nn.one_hot(z, VOCAB)
    return logits if previous is None else logits + 10.0 * previous

  def reads(key):
    fn = objective._self_conditioned(lambda z_t, t, previous=None: call(1.0, previous), key)
    return (fn(z, jnp.ones(1)) != call(1.0, None)).any()

  coins = np.asarray(jax.jit(jax.vmap(reads))(jax.random.split(jax.random.PRNGKey(0), 400)))
  assert abs(np.mean(coins) - 0.5) < 4 * 0.5 / np.sqrt(len(coins)), np.mean(coins)
  assert reads(None)  # Evaluation: always.

  def second_pass_sum(w):
    fn = objective._self_conditioned(lambda z_t, t, previous=None: call(w, previous), None)
    return fn(z, jnp.ones(1)).sum()

  # d/dw of w·onehot + 10·softmax(w·onehot) would add the softmax's slope without stop_gradient.
  assert float(jax.grad(second_pass_sum)(1.0)) == pytest.approx(float(z.size))


def test_the_network_starts_as_the_plain_one_and_checks_its_estimate():
  kwargs = dict(vocab_size=VOCAB, num_layers=1, model_dim=8, num_heads=2, mlp_dim=16)
  plain, conditioned = Transformer(**kwargs), Transformer(**kwargs, self_condition=True)
  z = jnp.array([[0, 1, 2, VOCAB]])
  params = conditioned.init(jax.random.PRNGKey(0), z)["params"]
  plain_params = {k: v for k, v in params.items() if k != "self_condition"}
  estimate = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (1, 4, VOCAB)), -1)
  expected = plain.apply({"params": plain_params}, z)
  got = conditioned.apply({"params": params}, z, previous=estimate)
  np.testing.assert_allclose(got, expected, rtol=1e-6)  # Zero-initialized projection.
  moved = jax.tree.map(lambda p: p + 0.1, params)
  np.testing.assert_allclose(
    conditioned.apply({"params": moved}, z, previous=jnp.zeros_like(estimate)),
    conditioned.apply({"params": moved}, z),
  )
  assert not np.allclose(
    conditioned.apply({"params": moved}, z, previous=estimate),
    conditioned.apply({"params": moved}, z),
  )
  with pytest.raises(ValueError, match="previous must be"):
    conditioned.apply({"params": params}, z, previous=estimate[:, :2])
  with pytest.raises(ValueError, match="self_condition=True"):
    plain.apply({"params": plain_params}, z, previous=estimate)


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"diffusion.block_size": 16, "training.estimator": "standard"}, "block_size=0"),
    ({"model.type": "ar", "model.time_conditioning": "none"}, "model.type='mdm'"),
    ({"sample.cache": "exact"}, "sample.cache='none'"),
    ({"model.shifted_prediction": True}, "shifted_prediction=False"),
    ({"model.shift_logits": True}, "shift_logits=False"),
    ({"eval.likelihood": "order"}, "eval.likelihood='nelbo'"),
    (
      {
        "diffusion.schedule": "learned_poly",
        "model.time_conditioning": "adaln",
        "training.estimator": "standard",
        "eval.estimator": "standard",
        "frontier.methods": "ancestral",
      },
      "mask-rate schedule",
    ),
  ],
)
def test_what_self_conditioning_cannot_read_is_a_one_line_config_error(overrides, message):
  config = config_lib.load_config("default")
  config.model.self_condition = True
  for key, value in overrides.items():
    section, leaf = key.split(".")
    config[section][leaf] = value
  with pytest.raises(ValueError, match=message) as error:
    config_lib.validate_config(config, num_devices=1)
  assert "\n" not in str(error.value)


def test_a_self_conditioned_uniform_model_trains_evaluates_and_samples(tmp_path):
  """The trainer end to end (tiny, 20 steps): the projection trains, the bound and samples read
  the estimate, and md4jax.load gives the model back."""
  config = config_lib.load_config("tiny")
  config.diffusion.process = "uniform"
  config.model.time_conditioning = "adaln"
  config.model.self_condition = True
  config.training.estimator = config.eval.estimator = "standard"
  config.frontier.methods = "ancestral"
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  results = modes.train_and_evaluate(config, tmp_path)
  assert results["nelbo_bits_per_token"] > 0
  loaded = md4jax.load(tmp_path)
  assert loaded.config.model.self_condition
  assert np.abs(np.asarray(loaded.params["self_condition"]["kernel"])).max() > 0  # Trained.
  samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert len(samples) == config.sample.num_samples
