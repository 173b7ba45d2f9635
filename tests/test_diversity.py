"""The leaderboard's diversity columns against a chain whose law is known: exact samples are 0
within their SE, a colder chain (what a low temperature samples) falls below, and the
statistics are what their formulas say on hand-made counts."""

import jax
import numpy as np
import pytest

from md4jax.diffusion import groundtruth
from md4jax.evaluation import estimates

VOCAB, LENGTH, N = 5, 24, 400


def _chain_entropy_rate(language) -> float:
  rows = -(language.transition * np.log2(language.transition)).sum(1)
  return float(language.initial @ rows)


def test_the_statistics_on_hand_made_samples():
  tokens = np.asarray([[0, 1, 0, 1], [1, 1, 1, 0]])
  counts = estimates.bigram_counts(tokens, 2)
  np.testing.assert_array_equal(counts, [[0, 2], [2, 2]])  # 0→1, 1→0 and 1→1 twice each.
  # Row 0 is certain (0 bits), row 1 a fair coin (1 bit): 4 of the 6 pairs leave state 1.
  assert estimates.chain_entropy(counts) == pytest.approx(4 / 6)
  # Frequencies (0, 1/3, 1/3, 1/3) against 1/4 each: ½ (1/4 + 3 · 1/12) = 1/4.
  assert estimates.bigram_tv(counts, np.full((2, 2), 0.25)) == pytest.approx(1 / 4)


def test_exact_samples_are_zero_and_a_colder_chain_is_not():
  language = groundtruth.MarkovLanguage(VOCAB, seed=2, concentration=0.5)
  truth = language.initial[:, None] * language.transition
  keys = jax.random.split(jax.random.PRNGKey(0), 33)
  references = [np.asarray(language.sample(k, N, LENGTH)) for k in keys[1:]]
  exact = np.asarray(language.sample(keys[0], N, LENGTH))
  figures = estimates.diversity(exact, truth, references)
  for name in ("chain_entropy", "bigram_tv"):
    assert abs(figures[f"{name}_excess"]) < 3 * figures[f"{name}_stderr"], figures
  # The plug-in entropy is close to the chain's entropy rate, and low by its finite-N bias.
  assert 0 < _chain_entropy_rate(language) - figures["chain_entropy"] < 0.02
  # Temperature 0.5: the transition rows squared and renormalized, a colder chain.
  squared = language.transition**2
  cold = groundtruth.MarkovLanguage.from_transition(squared / squared.sum(1, keepdims=True))
  colder = estimates.diversity(np.asarray(cold.sample(keys[0], N, LENGTH)), truth, references)
  assert colder["chain_entropy_excess"] < -4 * colder["chain_entropy_stderr"]
  assert colder["bigram_tv_excess"] > 4 * colder["bigram_tv_stderr"]
  collapsed = estimates.diversity(np.tile(exact[:1], (N, 1)), truth, references)
  assert collapsed["chain_entropy_excess"] < -4 * collapsed["chain_entropy_stderr"]
  assert collapsed["bigram_tv_excess"] > 10 * collapsed["bigram_tv_stderr"]
