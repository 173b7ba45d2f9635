"""Samplers on degenerate laws and broken logits: bounded calls, clean ids, clear errors.

Laws with exact-zero and one-hot transition rows, filters that leave one candidate, τ of 0
and 1, batches of 1 to 512, and denoisers whose logits are NaN, +inf or all −inf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from md4jax.diffusion import groundtruth, schedules
from md4jax.sampling import decoder, samplers

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 16
STEPS = {
  "ancestral": 24,
  "cached": 24,
  "jump": 24,
  "confidence": 24,
  "remdm": 24,
  "first_hitting": None,
  "threshold": None,
}


def zero_law():
  """Dirichlet(0.05) rows with their tiny entries set to exact zeros: 9 zeros, rows up to 0.99."""
  rows = np.random.default_rng(1).dirichlet(np.full(VOCAB, 0.05), size=VOCAB)
  rows = np.where(rows < 1e-4, 0.0, rows)
  return groundtruth.MarkovLanguage.from_transition(
    rows / rows.sum(-1, keepdims=True), initial=np.full(VOCAB, 1.0 / VOCAB)
  )


def one_hot_law():
  """A deterministic cycle 0 → 1 → ... → V−1 → 0 from a uniform start: log V nats a sequence."""
  return groundtruth.MarkovLanguage.from_transition(np.roll(np.eye(VOCAB), 1, axis=1))


LAWS = {"zeros": zero_law(), "one_hot": one_hot_law()}


def _sample(language, method, batch_size, seed=0, **kwargs):
  kwargs.setdefault("threshold", 0.9 if method == "threshold" else None)
  return decoder.sample(
    jax.random.PRNGKey(seed),
    language.denoise_fn(MASK_ID),
    batch_size=batch_size,
    length=LENGTH,
    mask_id=MASK_ID,
    method=method,
    schedule=schedules.get_schedule("linear"),
    num_steps=STEPS[method],
    **kwargs,
  )


def _assert_clean_within_calls(tokens, info, method, num_steps=None):
  tokens = np.asarray(tokens)
  assert tokens.min() >= 0 and tokens.max() < MASK_ID, (method, tokens.min(), tokens.max())
  calls = int(info["nfe"])
  assert 1 <= calls <= samplers.max_calls(method, LENGTH, num_steps or STEPS[method]), (
    method,
    calls,
  )


def test_the_laws_are_degenerate():
  assert np.sum(LAWS["zeros"].transition == 0) >= 6 and LAWS["zeros"].transition.max() > 0.95
  assert set(np.unique(LAWS["one_hot"].transition)) == {0.0, 1.0}
  assert LAWS["one_hot"].entropy(LENGTH) == pytest.approx(np.log(VOCAB))


@pytest.mark.parametrize("law", sorted(LAWS))
@pytest.mark.parametrize("method", samplers.METHODS)
@pytest.mark.parametrize("batch_size", [1, 512])
def test_every_sampler_returns_clean_ids_within_its_calls(law, method, batch_size):
  tokens, info = _sample(LAWS[law], method, batch_size)
  _assert_clean_within_calls(tokens, info, method)
  assert int(info["nonfinite_call"]) == -1


@pytest.mark.parametrize("batch_size", [8, 64, 256, 512])
@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_threshold_on_a_peaked_law_returns_within_L_calls(batch_size, threshold):
  # The reproduction of the hang: parallel reveals make pairs of probability 0, whose logits
  # the oracle once returned as NaN; a NaN row then picked a visible position as "the most
  # confident" and revealed nothing, for ever.
  tokens, info = _sample(LAWS["zeros"], "threshold", batch_size, threshold=threshold)
  _assert_clean_within_calls(tokens, info, "threshold")


@pytest.mark.parametrize("method", samplers.METHODS)
@pytest.mark.parametrize(
  "filters",
  [dict(top_k=1), dict(top_p=1e-6), dict(temperature=0.0), dict(temperature=1e-3)],
  ids=["top_k", "top_p", "greedy", "cold"],
)
def test_filters_that_leave_one_candidate(method, filters):
  tokens, info = _sample(LAWS["zeros"], method, 64, **filters)
  _assert_clean_within_calls(tokens, info, method)


def test_threshold_of_zero_reveals_everything_in_one_call_and_one_stays_within_L():
  _, info = _sample(LAWS["zeros"], "threshold", 64, threshold=0.0)
  assert int(info["nfe"]) == 1
  # The one-hot law: once any token is seen the rest are certain (probability exactly 1).
  tokens, info = _sample(LAWS["one_hot"], "threshold", 64, threshold=1.0)
  _assert_clean_within_calls(tokens, info, "threshold")
  assert int(info["nfe"]) == 2
  assert np.all(np.diff(np.asarray(tokens), axis=1) % VOCAB == 1)


@pytest.mark.parametrize("law", sorted(LAWS))
def test_first_hitting_draws_the_degenerate_law_exactly(law):
  language = LAWS[law]
  tokens, _ = _sample(language, "first_hitting", 4000, seed=3)
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  assert np.all(np.isfinite(nll)), "a sample of probability 0"
  gap, se = nll.mean() - language.entropy(LENGTH), nll.std(ddof=1) / np.sqrt(nll.size)
  assert abs(gap) < 4 * se + 1e-6, (gap, se)  # log_prob is float32: 1e-6 of rounding.
  first = np.bincount(np.asarray(tokens)[:, 0], minlength=VOCAB)
  expected = language.initial * len(tokens)
  assert np.sum((first - expected) ** 2 / expected) < scipy.stats.chi2.ppf(1 - 1e-4, VOCAB - 1)


# ---- Broken logits


def _broken(kind):
  def denoise(z, alpha):
    del alpha
    logits = jnp.zeros(z.shape + (MASK_ID,), jnp.float32)
    if kind == "nan":
      return logits + jnp.nan
    if kind == "posinf":
      return logits.at[..., 2].set(jnp.inf)
    return logits - jnp.inf  # "neginf": no token possible.

  return denoise


def _sample_broken(kind, method, jit):
  def run(key):
    return decoder.sample(
      key,
      _broken(kind),
      batch_size=8,
      length=LENGTH,
      mask_id=MASK_ID,
      schedule=schedules.get_schedule("linear"),
      method=method,
      num_steps=STEPS[method],
      threshold=0.9 if method == "threshold" else None,
    )

  return (jax.jit(run) if jit else run)(jax.random.PRNGKey(0))


@pytest.mark.parametrize("kind", ["nan", "posinf", "neginf"])
@pytest.mark.parametrize("method", samplers.METHODS)
def test_broken_logits_are_an_error_naming_the_sampler_and_the_call(kind, method):
  with pytest.raises(
    samplers.NonFiniteLogitsError, match=rf"sampler '{method}': network call 1 of "
  ):
    _sample_broken(kind, method, jit=False)


@pytest.mark.parametrize("method", samplers.METHODS)
def test_broken_logits_inside_a_callers_jit_still_end_clean_and_are_reported(method):
  tokens, info = _sample_broken("nan", method, jit=True)
  _assert_clean_within_calls(tokens, info, method)
  assert int(info["nonfinite_call"]) == 0
  with pytest.raises(samplers.NonFiniteLogitsError, match=method):
    samplers.check_logits(info, method)


def test_threshold_ends_when_rows_of_probability_zero_get_nan_logits():
  # The hang's state without the oracle's guard: a row whose visible tokens have probability 0
  # gets NaN logits; its masked positions must still be revealed, one or more per call.
  language = LAWS["zeros"]
  oracle, log_transition = language.denoise_fn(MASK_ID), jnp.log(jnp.asarray(language.transition))

  def denoise(z, alpha):
    seen = (z[:, :-1] != MASK_ID) & (z[:, 1:] != MASK_ID)
    pair = log_transition[jnp.minimum(z[:, :-1], VOCAB - 1), jnp.minimum(z[:, 1:], VOCAB - 1)]
    impossible = jnp.any(seen & jnp.isneginf(pair), axis=1)
    return jnp.where(impossible[:, None, None], jnp.nan, oracle(z, alpha))

  run = jax.jit(
    lambda key: decoder.sample(
      key,
      denoise,
      batch_size=256,
      length=LENGTH,
      mask_id=MASK_ID,
      method="threshold",
      schedule=schedules.get_schedule("linear"),
      threshold=0.9,
    )
  )
  tokens, info = run(jax.random.PRNGKey(0))
  _assert_clean_within_calls(tokens, info, "threshold")
  assert int(info["nonfinite_call"]) >= 0  # Such rows did occur, and were reported.


def test_broken_logits_at_visible_positions_only_are_harmless():
  def denoise(z, alpha):
    del alpha
    logits = jnp.zeros(z.shape + (MASK_ID,), jnp.float32)
    return jnp.where((z == MASK_ID)[..., None], logits, jnp.nan)

  tokens, info = decoder.sample(
    jax.random.PRNGKey(0),
    denoise,
    batch_size=4,
    length=LENGTH,
    mask_id=MASK_ID,
    schedule=schedules.get_schedule("linear"),
    method="first_hitting",
  )
  _assert_clean_within_calls(tokens, info, "first_hitting")


# ---- Prompts


def test_a_prompt_position_given_as_the_mask_id_is_filled_or_refused():
  prompt = jnp.array([3] + [MASK_ID] * (LENGTH - 1))
  tokens, _ = _sample(LAWS["one_hot"], "first_hitting", 4, prompt=prompt)
  np.testing.assert_array_equal(np.asarray(tokens)[0], (3 + np.arange(LENGTH)) % VOCAB)
  with pytest.raises(ValueError, match="prompt_mask marks a position whose prompt id is the mask"):
    _sample(LAWS["one_hot"], "first_hitting", 4, prompt=prompt, prompt_mask=jnp.ones(LENGTH, bool))
  with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 6\]"):
    _sample(LAWS["one_hot"], "first_hitting", 4, prompt=prompt.at[1].set(7))


# ---- The public function compiles once


def test_a_second_call_with_the_same_denoiser_does_not_compile():
  compiles = []

  def listen(event, duration, **_):
    if "backend_compile" in event:
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    denoise = LAWS["zeros"].denoise_fn(MASK_ID)
    run = lambda seed: decoder.sample(
      jax.random.PRNGKey(seed),
      denoise,
      batch_size=64,
      length=LENGTH,
      mask_id=MASK_ID,
      method="first_hitting",
      schedule=schedules.get_schedule("linear"),
    )
    first, _ = run(0)
    compiled = len(compiles)
    second, _ = run(1)
    assert compiled >= 1 and len(compiles) == compiled
    assert not np.array_equal(np.asarray(first), np.asarray(second))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
