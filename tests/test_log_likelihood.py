"""md4jax.diffusion.log_likelihood against the exact oracle.

With the generated language's exact denoiser, log π(completion | prompt) is known in closed
form: "nelbo" and "coupled" must be unbiased for it (4 standard errors over many draws), and
d1's one-step estimate without prompt masking must equal Σ_ℓ log p(x_ℓ | prompt) exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import log_likelihood as log_likelihood_lib
from md4jax.diffusion.groundtruth import MarkovLanguage

VOCAB, LENGTH, PROMPT = 4, 7, 2
LANGUAGE = MarkovLanguage(VOCAB, seed=2, concentration=1.0)
ORACLE = LANGUAGE.denoise_fn(VOCAB)


def _editable(rows):
  return jnp.broadcast_to(jnp.arange(LENGTH) >= PROMPT, (rows, LENGTH))


def _exact(x):
  """log p(x_PROMPT.. | x_..PROMPT) of each row, float64."""
  x = np.asarray(x)
  steps = np.log(LANGUAGE.transition[x[:, :-1], x[:, 1:]])
  return steps[:, PROMPT - 1 :].sum(-1)


def _estimates(estimator, x, copies, draws=1, key=0):
  """`copies` independent estimates of each row of x: [copies, B]."""
  tiled = jnp.tile(x, (copies, 1))
  values = log_likelihood_lib.log_likelihood(
    jax.random.PRNGKey(key),
    ORACLE,
    tiled,
    mask_id=VOCAB,
    editable=_editable(tiled.shape[0]),
    estimator=estimator,
    draws=draws,
  )
  return np.asarray(values, np.float64).reshape(copies, x.shape[0])


@pytest.mark.parametrize("estimator, draws", [("nelbo", 1), ("nelbo", 4), ("coupled", 1)])
def test_unbiased_for_the_exact_log_likelihood(estimator, draws):
  x = LANGUAGE.sample(jax.random.PRNGKey(1), 6, LENGTH)
  errors = _estimates(estimator, x, copies=1500, draws=draws) - _exact(x)
  per_row = errors.mean(0)
  standard_errors = errors.std(0, ddof=1) / np.sqrt(errors.shape[0])
  assert np.all(np.abs(per_row) < 4.5 * standard_errors + 1e-4), (per_row, standard_errors)
  # Not a vacuous check: every row's estimate varies from draw to draw.
  assert np.all(errors.std(0) > 1e-3)


def test_more_draws_lower_the_variance():
  x = LANGUAGE.sample(jax.random.PRNGKey(3), 4, LENGTH)
  one = _estimates("nelbo", x, copies=600, draws=1).var(0)
  four = _estimates("nelbo", x, copies=600, draws=4, key=1).var(0)
  np.testing.assert_allclose(four / one, 0.25, rtol=0.35)


def test_one_step_without_prompt_masking_is_the_sum_of_marginals():
  x = LANGUAGE.sample(jax.random.PRNGKey(4), 16, LENGTH)
  got = log_likelihood_lib.log_likelihood(
    jax.random.PRNGKey(0),
    ORACLE,
    x,
    mask_id=VOCAB,
    editable=_editable(16),
    estimator="d1",
    prompt_mask_prob=0.0,
  )
  x = np.asarray(x)
  want = np.zeros(16)
  for position in range(PROMPT, LENGTH):
    power = np.linalg.matrix_power(LANGUAGE.transition, position - PROMPT + 1)
    want += np.log(power[x[:, PROMPT - 1], x[:, position]])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def _spy(seen):
  def denoise(z, alpha):
    seen.append(np.asarray(z))
    return ORACLE(z, alpha)

  return denoise


@pytest.mark.parametrize("estimator", log_likelihood_lib.ESTIMATORS)
def test_same_key_same_draws_and_batch_invariant(estimator):
  """A policy and its reference called with one key see the same masked inputs (VRPO's shared
  draws); a row sees the same inputs alone and in a batch (its row index fixes its draws)."""
  x = LANGUAGE.sample(jax.random.PRNGKey(5), 8, LENGTH)
  first, second = [], []
  arguments = dict(mask_id=VOCAB, editable=_editable(8), estimator=estimator, draws=2)
  key = jax.random.PRNGKey(7)
  batch = log_likelihood_lib.log_likelihood(key, _spy(first), x, **arguments)
  log_likelihood_lib.log_likelihood(key, _spy(second), x, **arguments)
  assert len(first) == len(second) > 0
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)
  single = []
  alone = log_likelihood_lib.log_likelihood(
    key, _spy(single), x[5:6], row_index=jnp.array([5]), **(arguments | dict(editable=_editable(1)))
  )
  for a, b in zip(single, first):
    np.testing.assert_array_equal(a[0], b[5])
  # The same inputs; the oracle's float32 forward-backward may round differently at batch 1.
  np.testing.assert_allclose(np.asarray(alone), np.asarray(batch)[5:6], rtol=1e-6)


def _inputs_seen(estimator, x, seed, **arguments) -> list:
  """The denoiser's inputs [B, L] of each call of one estimate of x's rows."""
  seen = []
  log_likelihood_lib.log_likelihood(
    jax.random.PRNGKey(seed),
    _spy(seen),
    x,
    mask_id=VOCAB,
    editable=_editable(x.shape[0]),
    estimator=estimator,
    **arguments,
  )
  return seen


def test_d1_masks_the_prompt_at_its_rate_and_every_completion_token():
  (z,) = _inputs_seen("d1", jnp.zeros((4000, LENGTH), jnp.int32), 0, prompt_mask_prob=0.3)
  assert np.all(z[:, PROMPT:] == VOCAB)
  rate = (z[:, :PROMPT] == VOCAB).mean()
  assert abs(rate - 0.3) < 4 * np.sqrt(0.3 * 0.7 / z[:, :PROMPT].size)


def test_coupled_scores_every_completion_token_exactly_once():
  x = LANGUAGE.sample(jax.random.PRNGKey(6), 64, LENGTH)
  first, second = (z == VOCAB for z in _inputs_seen("coupled", x, 1))
  np.testing.assert_array_equal(first ^ second, np.asarray(_editable(64)))


@pytest.mark.parametrize(
  "arguments, message",
  [
    (dict(estimator="exact"), "Unknown estimator 'exact'"),
    (dict(draws=0), "draws must be an integer >= 1"),
    (dict(prompt_mask_prob=1.0), r"prompt_mask_prob must be in \[0, 1\)"),
  ],
)
def test_bad_arguments(arguments, message):
  x = jnp.zeros((2, LENGTH), jnp.int32)
  with pytest.raises(ValueError, match=message):
    log_likelihood_lib.log_likelihood(
      jax.random.PRNGKey(0), ORACLE, x, mask_id=VOCAB, editable=_editable(2), **arguments
    )
