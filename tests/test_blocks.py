"""Block diffusion's bound (BD3-LM) through the reference path, against the exact Markov oracle:
unbiased for the exact NLL at every block size, an autoregressive NLL at block size 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import bounds, groundtruth, schedules

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 8


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=2)


@pytest.fixture(scope="module")
def data(language):
  return language.sample(jax.random.PRNGKey(0), 4000, LENGTH)


@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("estimator", ["standard", "mask_count"])
def test_the_block_bound_is_unbiased_for_the_exact_nll(language, data, block_size, estimator):
  run = jax.jit(
    lambda key: bounds.nelbo(
      key,
      language.denoise_fn(MASK_ID),
      data,
      schedules.get_schedule("cosine"),
      mask_id=MASK_ID,
      estimator=estimator,
      block_size=block_size,
    )
  )
  excess = np.asarray(run(jax.random.PRNGKey(1)), np.float64) + np.asarray(
    language.log_prob(data), np.float64
  )
  assert abs(excess.mean()) < 4 * excess.std(ddof=1) / np.sqrt(excess.size) + 1e-4, excess.mean()


def test_block_size_one_is_the_autoregressive_nll_term_by_term(language, data):
  # One token per block, always masked under mask_count: each term is exactly
  # −log p(x_ℓ | x_<ℓ), so the bound is the exact NLL of every sequence, not just on average.
  nats = bounds.nelbo(
    jax.random.PRNGKey(2),
    language.denoise_fn(MASK_ID),
    data[:64],
    schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    estimator="mask_count",
    block_size=1,
  )
  np.testing.assert_allclose(nats, -np.asarray(language.log_prob(data[:64])), rtol=2e-5)


def test_the_whole_sequence_as_one_block_is_the_mdm_bound_to_the_bit(language, data):
  args = (jax.random.PRNGKey(3), language.denoise_fn(MASK_ID), data[:64], "linear")
  np.testing.assert_array_equal(
    bounds.nelbo(*args, mask_id=MASK_ID, block_size=LENGTH), bounds.nelbo(*args, mask_id=MASK_ID)
  )


def test_smaller_blocks_give_a_tighter_bound_for_an_imperfect_denoiser(language, data):
  # A denoiser that reads only the left neighbour (the stationary law when it is masked): with
  # one-token blocks it always sees it, so it is exact; with one block of L it often does not.
  log_transition = jnp.log(jnp.asarray(language.transition, jnp.float32))
  log_initial = jnp.log(jnp.asarray(language.initial, jnp.float32))

  def left_only(z, alpha):
    del alpha
    left = jnp.pad(z[:, :-1], ((0, 0), (1, 0)), constant_values=MASK_ID)
    return jnp.where(
      (left == MASK_ID)[..., None], log_initial, log_transition[jnp.minimum(left, VOCAB - 1)]
    )

  means = [
    float(
      bounds.nelbo(
        jax.random.PRNGKey(4),
        left_only,
        data,
        "linear",
        mask_id=MASK_ID,
        estimator="mask_count",
        block_size=b,
      ).mean()
    )
    for b in (1, 4, 8)
  ]
  exact = -float(np.mean(language.log_prob(data)))
  assert abs(means[0] - exact) < 1e-4 * exact and means[0] < means[1] < means[2], (means, exact)


def test_block_size_must_divide_the_length(language, data):
  with pytest.raises(ValueError, match="block_size must divide the length 8, got 3"):
    bounds.nelbo(
      jax.random.PRNGKey(0),
      language.denoise_fn(MASK_ID),
      data[:4],
      "linear",
      mask_id=MASK_ID,
      block_size=3,
    )


def test_clipped_mask_rates_split_the_bound(language, data):
  # BD3-LM's clipped schedule estimates the average of the integrand over its mask rates, so the
  # halves [0, 1/2] and [1/2, 1] average to the whole bound (the exact NLL with the oracle).
  schedule = schedules.get_schedule("linear")

  def halves(mask_rates, block_size):
    return jax.jit(
      lambda key: bounds.nelbo(
        key,
        language.denoise_fn(MASK_ID),
        data,
        schedule,
        mask_id=MASK_ID,
        block_size=block_size,
        mask_rates=mask_rates,
      )
    )(jax.random.PRNGKey(5))

  for block_size in (4, 8):
    low, high = (np.asarray(halves(r, block_size), np.float64) for r in ((0.0, 0.5), (0.5, 1.0)))
    excess = 0.5 * (low + high) + np.asarray(language.log_prob(data), np.float64)
    assert abs(excess.mean()) < 4 * excess.std(ddof=1) / np.sqrt(excess.size), excess.mean()
    assert high.mean() > 1.2 * low.mean()  # At high mask rates a token has less context.


def test_clipped_draws_stay_in_their_mask_rates(data):
  from md4jax.diffusion import blocks  # pylint: disable=import-outside-toplevel

  draws = blocks.draws(
    jax.random.PRNGKey(0), data[:64], schedules.get_schedule("cosine"), 4, mask_rates=(0.3, 0.8)
  )
  rates = 1.0 - np.asarray(schedules.get_schedule("cosine").alpha(draws["t"]))
  assert rates.min() >= 0.3 - 1e-5 and rates.max() <= 0.8 + 1e-5 and rates.std() > 0.1
  with pytest.raises(ValueError, match="mask_rates"):
    bounds.nelbo(
      jax.random.PRNGKey(0),
      lambda z, a: None,
      data[:4],
      "linear",
      mask_id=MASK_ID,
      estimator="mask_count",
      mask_rates=(0.1, 0.9),
    )
