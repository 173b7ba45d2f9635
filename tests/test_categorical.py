"""Float64-accurate categorical draws and logit filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.sampling import categorical

VOCAB = 16384
TAIL_LOGIT = -15.5
NUM_DRAWS = 200_000


def _tail_fraction(noise):
  logits = jnp.full((2000, VOCAB), TAIL_LOGIT).at[:, 0].set(0.0)
  draw = jax.jit(lambda key: categorical.sample_categorical(key, logits, noise=noise))
  draws = np.concatenate(
    [np.asarray(draw(jax.random.PRNGKey(i))) for i in range(NUM_DRAWS // 2000)]
  )
  return np.mean(draws != 0)


@pytest.fixture(scope="module")
def exact_tail_mass():
  tail = (VOCAB - 1) * np.exp(TAIL_LOGIT)
  return tail / (1.0 + tail)  # 0.00303


@pytest.mark.slow  # 3.3e9 noise draws: minutes on 2 cores.
def test_float64_noise_reproduces_the_tail_of_a_peaked_categorical(exact_tail_mass):
  """One logit 0, 16,383 at −15.5: the tail mass 0.00303 within 5σ (binomial σ)."""
  sigma = np.sqrt(exact_tail_mass * (1 - exact_tail_mass) / NUM_DRAWS)
  assert abs(_tail_fraction("float64") - exact_tail_mass) < 5 * sigma


@pytest.mark.slow  # 3.3e9 noise draws: minutes on 2 cores.
def test_float32_gumbel_measurably_undershoots_the_tail(exact_tail_mass):
  """float32 Gumbel noise tops out near 16.6, so the −15.5 tail is cut (> 5σ low)."""
  sigma = np.sqrt(exact_tail_mass * (1 - exact_tail_mass) / NUM_DRAWS)
  assert _tail_fraction("float32") < exact_tail_mass - 5 * sigma


def test_float64_draws_match_a_small_categorical():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.log(jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (50_000, 4)))
  counts = np.bincount(
    np.asarray(categorical.sample_categorical(jax.random.PRNGKey(0), logits)), minlength=4
  )
  expected = probs * 50_000
  chi2 = np.sum((counts - expected) ** 2 / expected)
  assert chi2 < 21.1  # χ²(3) critical value at p = 1e-4.


def test_exponential_noise_is_accurate_near_zero():
  exponential = np.asarray(categorical._accurate_exponential(jax.random.PRNGKey(0), (1_000_000,)))
  assert exponential.min() > 0 and np.all(np.isfinite(exponential))
  # P(E < 1e-4) ≈ 1e-4: Poisson count, 5σ.
  assert abs(np.sum(exponential < 1e-4) - 100) < 5 * np.sqrt(100)
  assert abs(exponential.mean() - 1.0) < 5 / np.sqrt(1_000_000)


def test_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  top2 = categorical.filter_logits(logits, top_k=2)
  np.testing.assert_array_equal(np.isfinite(top2), [[True, True, False, False]])
  nucleus = categorical.filter_logits(logits, top_p=0.7)  # 0.5 < 0.7 ≤ 0.8: keep two.
  np.testing.assert_array_equal(np.isfinite(nucleus), [[True, True, False, False]])
  assert np.isfinite(categorical.filter_logits(logits, top_p=0.4)).sum() == 1
  np.testing.assert_allclose(categorical.filter_logits(logits, temperature=0.5), logits / 0.5)
  greedy = categorical.sample_categorical(
    jax.random.PRNGKey(0), jnp.tile(logits, (10, 1)), temperature=0.0
  )
  np.testing.assert_array_equal(greedy, 0)
  for bad in [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)]:
    with pytest.raises(ValueError):
      categorical.filter_logits(logits, **bad)
  with pytest.raises(ValueError, match="noise"):
    categorical.gumbel(jax.random.PRNGKey(0), (3,), noise="float16")
