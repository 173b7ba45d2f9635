"""Any-order likelihoods against the exact Markov oracle: every order's chain rule is the exact
NLL, and over random orders the importance-weighted bound sits between the exact NLL and the
NELBO, tightening with K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import bounds, groundtruth, orders

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 8


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=2)


@pytest.fixture(scope="module")
def data(language):
  return language.sample(jax.random.PRNGKey(0), 2000, LENGTH)


def _exact_nll(language, x):
  return -np.asarray(language.log_prob(x), np.float64)


def _log_marginal(language, x, visible):
  """log p(x at the visible positions) of each row, by the forward algorithm (float64)."""
  x, visible = np.asarray(x), np.asarray(visible)
  message = np.broadcast_to(language.initial, (x.shape[0], VOCAB))
  log_total = np.zeros(x.shape[0])
  for position in range(x.shape[1]):
    if position:
      message = message @ language.transition
    evidence = np.where(visible[:, position, None], np.eye(VOCAB)[x[:, position]], 1.0)
    message = message * evidence
    scale = message.sum(-1)
    log_total += np.log(scale)
    message = message / scale[:, None]
  return log_total


def _tempered(language, temperature=0.6):
  """An imperfect time-free denoiser: the exact posterior, sharpened."""
  exact = language.denoise_fn(MASK_ID)
  return lambda z, alpha: exact(z, alpha) / temperature


@pytest.mark.parametrize("which", ["left_to_right", "right_to_left", "random", "per_row"])
def test_every_order_gives_the_exact_nll_of_each_sequence(language, data, which):
  x = data[:256]
  order = {
    "left_to_right": jnp.arange(LENGTH),
    "right_to_left": jnp.arange(LENGTH)[::-1],
    "random": jax.random.permutation(jax.random.PRNGKey(1), LENGTH),
    "per_row": orders.random_orders(jax.random.PRNGKey(2), x.shape[0], LENGTH),
  }[which]
  nats = orders.order_nll(language.denoise_fn(MASK_ID), x, order, mask_id=MASK_ID)
  np.testing.assert_allclose(nats, _exact_nll(language, x), rtol=1e-5)


def test_fixed_positions_are_shown_and_never_scored(language, data):
  # Per-row prompts and scattered fixed positions: the chain rule over the editable ones is
  # −log p(x_E | x_rest), which holds only if every fixed position is visible at every step.
  x = data[:256]
  editable = jax.random.bernoulli(jax.random.PRNGKey(3), 0.6, x.shape)
  editable = editable.at[:4].set(False).at[4:8].set(True)  # Nothing editable; all editable.
  nats = jax.jit(
    lambda x, editable: orders.iw_orders_nll(
      jax.random.PRNGKey(4), language.denoise_fn(MASK_ID), x, 2, mask_id=MASK_ID, editable=editable
    )
  )(x, editable)
  shown = np.asarray(~editable)
  expected = _exact_nll(language, x) + _log_marginal(language, x, shown)
  np.testing.assert_allclose(nats, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(nats[:4], 0.0)


def test_random_orders_are_per_row_permutations_from_the_row_index():
  drawn = np.asarray(orders.random_orders(jax.random.PRNGKey(5), 16, LENGTH))
  np.testing.assert_array_equal(np.sort(drawn, axis=-1), np.tile(np.arange(LENGTH), (16, 1)))
  assert len({tuple(row) for row in drawn}) > 8
  np.testing.assert_array_equal(orders.random_orders(jax.random.PRNGKey(5), 4, LENGTH), drawn[:4])


@pytest.fixture(scope="module")
def imperfect(language, data):
  """−log p_π of K = 8 random orders of each row, [8, B], under the tempered denoiser."""
  denoise = _tempered(language)

  def nlls(key):
    return jax.lax.map(
      lambda k: orders.order_nll(
        denoise,
        data,
        orders.random_orders(jax.random.fold_in(key, k), *data.shape),
        mask_id=MASK_ID,
      ),
      jnp.arange(8),
    )

  return np.asarray(jax.jit(nlls)(jax.random.PRNGKey(6)), np.float64)


def _iw(nlls):
  return np.log(nlls.shape[0]) - np.logaddexp.reduce(-nlls, axis=0)


def _mean_se(values):
  return values.mean(), values.std(ddof=1) / np.sqrt(values.size)


def test_iw_orders_nll_is_the_logsumexp_over_its_orders(language, data):
  denoise = _tempered(language)
  key = jax.random.PRNGKey(7)
  got = orders.iw_orders_nll(key, denoise, data[:64], 3, mask_id=MASK_ID)
  each = np.stack(
    [
      orders.order_nll(
        denoise,
        data[:64],
        orders.random_orders(jax.random.fold_in(key, k), 64, LENGTH),
        mask_id=MASK_ID,
      )
      for k in range(3)
    ]
  ).astype(np.float64)
  np.testing.assert_allclose(got, _iw(each), rtol=1e-5)


def test_the_iw_bound_is_above_the_exact_nll_and_tightens_with_k(language, data, imperfect):
  exact = _exact_nll(language, data)
  one, eight = imperfect[0], _iw(imperfect)
  excess, excess_se = _mean_se(eight - exact)  # ≥ the KL to the true law, in expectation.
  gain, gain_se = _mean_se(one - eight)
  assert excess > 4 * excess_se, (excess, excess_se)
  assert gain > 4 * gain_se, (gain, gain_se)
  # Row by row (Jensen): between the best order's NLL and the orders' mean NLL.
  assert np.all((imperfect.min(0) - 1e-9 <= eight) & (eight <= imperfect.mean(0) + 1e-9))


def test_one_order_has_the_nelbo_mean(language, data, imperfect):
  nelbo = jax.jit(
    lambda key: bounds.nelbo(
      key,
      _tempered(language),
      data,
      "linear",
      mask_id=MASK_ID,
      estimator="mask_count",
      t_sampling="uniform",
    )
  )
  nelbo = np.mean([np.asarray(nelbo(jax.random.PRNGKey(10 + j))) for j in range(4)], axis=0)
  difference, se = _mean_se(imperfect.mean(0) - nelbo)
  assert abs(difference) < 4 * se, (difference, se)


def test_the_loop_holds_one_network_call(language, data):
  traces = []

  def counted(z, alpha):
    traces.append(z.shape)
    return language.denoise_fn(MASK_ID)(z, alpha)

  jax.jit(lambda x: orders.iw_orders_nll(jax.random.PRNGKey(8), counted, x, 4, mask_id=MASK_ID))(
    data[:8]
  )
  assert len(traces) == 1, traces


def test_num_orders_must_be_a_positive_integer(language, data):
  with pytest.raises(ValueError, match="num_orders must be an integer >= 1, got 0"):
    orders.iw_orders_nll(
      jax.random.PRNGKey(0), language.denoise_fn(MASK_ID), data[:2], 0, mask_id=MASK_ID
    )
