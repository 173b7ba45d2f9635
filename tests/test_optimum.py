"""md4jax.diffusion.optimum: the KL-regularised optimum of a bigram reward, against enumeration.

Every sequence of a small language is enumerated in float64: π*(x) = p(x) exp(r(x)/β) / Z by
definition, and the backward recursion's chain must give the same law, Z, reward and KL; and
E_π[r] − β KL(π ‖ p) must be largest at π* (= β log Z) among perturbed laws.
"""

import itertools

import jax
import numpy as np
import pytest
from scipy import stats

from md4jax.diffusion import optimum
from md4jax.diffusion.groundtruth import MarkovLanguage

VOCAB, LENGTH = 3, 5


def _all_sequences():
  return np.array(list(itertools.product(range(VOCAB), repeat=LENGTH)), np.int64)


def _bigram_reward(x, reward):
  return reward[x[:, :-1], x[:, 1:]].sum(-1)


def _enumerated(language, reward, beta):
  """(sequences, p, π*, log Z) by brute force."""
  x = _all_sequences()
  log_p = np.log(language.initial[x[:, 0]]) + np.log(language.transition[x[:, :-1], x[:, 1:]]).sum(
    -1
  )
  tilted = log_p + _bigram_reward(x, reward) / beta
  log_z = np.logaddexp.reduce(tilted)
  return x, np.exp(log_p), np.exp(tilted - log_z), log_z


@pytest.mark.parametrize("beta", [0.05, 0.5, 4.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_backward_recursion_is_the_enumerated_optimum(beta, seed):
  language = MarkovLanguage(VOCAB, seed=seed)
  reward = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB))
  chain, log_z = optimum.kl_optimum(language, reward, beta, LENGTH)
  x, p, target, want_log_z = _enumerated(language, reward, beta)
  np.testing.assert_allclose(np.exp(chain.log_prob(x)), target, rtol=1e-10, atol=1e-300)
  np.testing.assert_allclose(log_z, want_log_z, rtol=1e-12)
  expected_reward = target @ _bigram_reward(x, reward)
  np.testing.assert_allclose(chain.expected_reward(reward), expected_reward, rtol=1e-10)
  kl = target @ np.log(target / p)
  np.testing.assert_allclose(chain.kl_to(language), kl, rtol=1e-9, atol=1e-12)
  # The optimum's value, β log Z, and KL(π* ‖ p) = E_π*[r]/β − log Z.
  np.testing.assert_allclose(expected_reward - beta * kl, beta * log_z, rtol=1e-9)


def test_no_other_law_does_better():
  """E_q[r] − β KL(q ‖ p) < β log Z for laws q near π* (by the Gibbs variational principle the gap
  is β KL(q ‖ π*))."""
  language, beta = MarkovLanguage(VOCAB, seed=3), 0.3
  reward = np.random.default_rng(3).normal(size=(VOCAB, VOCAB))
  _, log_z = optimum.kl_optimum(language, reward, beta, LENGTH)
  x, p, target, _ = _enumerated(language, reward, beta)
  rng = np.random.default_rng(0)
  for _ in range(5):
    q = target * np.exp(0.1 * rng.normal(size=target.shape))
    q /= q.sum()
    value = q @ _bigram_reward(x, reward) - beta * (q @ np.log(q / p))
    gap = beta * (q @ np.log(q / target))
    assert value < beta * log_z
    np.testing.assert_allclose(beta * log_z - value, gap, rtol=1e-8)


def test_large_rewards_do_not_overflow():
  language = MarkovLanguage(VOCAB, seed=0)
  reward = np.full((VOCAB, VOCAB), 500.0)
  reward[0, 1] = 800.0
  chain, log_z = optimum.kl_optimum(language, reward, 0.01, 64)
  assert np.isfinite(log_z) and np.all(np.isfinite(chain.transitions))
  np.testing.assert_allclose(chain.transitions.sum(-1), 1.0)


def test_samples_follow_the_chain():
  """Pearson χ² of each position's pairs against the chain's pair laws (p = 1e-4 per test), and
  `bigram_distance` of samples against the exact distance."""
  language = MarkovLanguage(VOCAB, seed=1)
  reward = np.random.default_rng(1).normal(size=(VOCAB, VOCAB))
  chain, _ = optimum.kl_optimum(language, reward, 0.5, LENGTH)
  n = 20000
  x = np.asarray(chain.sample(jax.random.PRNGKey(0), n))
  assert x.shape == (n, LENGTH) and x.dtype == np.int32
  for position, law in enumerate(chain.pair_laws()):
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (x[:, position], x[:, position + 1]), 1)
    chi2 = ((counts - n * law) ** 2 / (n * law)).sum()
    assert chi2 < stats.chi2.ppf(1 - 1e-4, VOCAB * VOCAB - 1), position
  # The bigram distance of samples: near 0 for the chain's own, near the exact distance between
  # the two laws' expected frequencies for the language's.
  assert optimum.bigram_distance(x, chain) < 0.02
  base = optimum.PositionalChain(
    language.initial, np.broadcast_to(language.transition, (LENGTH - 1, VOCAB, VOCAB))
  )
  exact = 0.5 * np.abs(base.bigram_frequencies() - chain.bigram_frequencies()).sum()
  other = np.asarray(language.sample(jax.random.PRNGKey(1), n, LENGTH))
  assert exact > 0.1 and abs(optimum.bigram_distance(other, chain) - exact) < 0.02
  with pytest.raises(ValueError, match=rf"not \[N, {LENGTH}\]"):
    optimum.bigram_distance(x[:, :-1], chain)
  with pytest.raises(ValueError, match="outside"):
    optimum.bigram_distance(np.full_like(x, VOCAB), chain)


@pytest.mark.parametrize(
  "arguments, message",
  [
    (dict(beta=0.0), "beta must be > 0"),
    (dict(beta=-1.0), "beta must be > 0"),
    (dict(reward=np.zeros((2, 2))), r"must be \[V, V\]"),
    (dict(reward=np.full((VOCAB, VOCAB), np.nan)), "NaN"),
    (dict(length=1), "length must be >= 2"),
  ],
)
def test_bad_arguments_are_one_line_errors(arguments, message):
  values = dict(reward=np.zeros((VOCAB, VOCAB)), beta=1.0, length=LENGTH) | arguments
  with pytest.raises(ValueError, match=message):
    optimum.kl_optimum(MarkovLanguage(VOCAB), **values)


def test_a_law_off_the_languages_support_is_infinitely_far():
  language = MarkovLanguage.from_transition(np.array([[1.0, 0.0], [0.5, 0.5]]), [0.5, 0.5])
  inside = optimum.PositionalChain([0.5, 0.5], [[[1.0, 0.0], [0.5, 0.5]]])
  outside = optimum.PositionalChain([0.5, 0.5], [[[0.9, 0.1], [0.5, 0.5]]])
  assert inside.kl_to(language) == 0.0 and outside.kl_to(language) == np.inf
