"""Samplers of the uniform-state process (`md4jax.sample(…, process="uniform")`) on the exact oracle.

The ancestral sampler's exact law is computed by enumeration (V = 3, L = 4: 81 sequences; each
step's kernel is the product over positions of `uniform.reverse_probs`), and the draws are
tested against it with a chi-square test at p = 1e-4 (cells with fewer than 5 expected merged).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import md4jax
from md4jax.diffusion import groundtruth, schedules, uniform

VOCAB, LENGTH = 3, 4
P_VALUE = 1e-4


@pytest.fixture(scope="module")
def chain():
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  every = np.array(list(itertools.product(range(VOCAB), repeat=LENGTH)), np.int32)
  true_law = np.exp(np.asarray(language.log_prob(jnp.asarray(every)), np.float64))
  return language, every, true_law


def _exact_sampler_law(language, every, schedule, num_steps):
  """The law of the ancestral sampler's output, [V^L]: uniform start, one kernel per step."""
  denoise, z = language.uniform_denoise_fn(), jnp.asarray(every)

  @jax.jit
  def kernel(t, s):  # [z, z'] = Π_ℓ p(z'_ℓ | z)
    alpha_t = jnp.full(len(every), schedule.alpha(t), jnp.float32)
    alpha_s = jnp.full(len(every), schedule.alpha(s), jnp.float32)
    step = uniform.reverse_probs(jax.nn.softmax(denoise(z, alpha_t), -1), z, alpha_t, alpha_s)
    return jnp.prod(step[:, jnp.arange(LENGTH)[None, :], z], axis=-1)

  law = np.full(len(every), 1.0 / len(every))
  for i in range(num_steps, 0, -1):
    law = law @ np.asarray(kernel(i / num_steps, (i - 1) / num_steps), np.float64)
  return law / law.sum()


def _counts(tokens):
  index = (np.asarray(tokens) * VOCAB ** np.arange(LENGTH - 1, -1, -1)).sum(-1)
  return np.bincount(index, minlength=VOCAB**LENGTH)


def _chi_square_p(counts, law):
  expected = law * counts.sum()
  order = np.argsort(expected)
  small = expected[order] < 5.0
  merged_counts = np.append(counts[order][~small], counts[order][small].sum())
  merged_expected = np.append(expected[order][~small], expected[order][small].sum())
  statistic = np.sum((merged_counts - merged_expected) ** 2 / merged_expected)
  return stats.chi2.sf(statistic, len(merged_counts) - 1)


def _sample(language, n, num_steps, key=0, **kwargs):
  tokens, info = md4jax.sample(
    jax.random.PRNGKey(key),
    language.uniform_denoise_fn(kwargs.pop("editable", None)),
    batch_size=n,
    length=LENGTH,
    schedule=kwargs.pop("schedule", "linear"),
    num_steps=num_steps,
    process="uniform",
    **kwargs,
  )
  return np.asarray(tokens), info


def test_the_ancestral_law_tends_to_the_chain_as_steps_grow(chain):
  """Exact, by enumeration: the only error is the per-position factorization of each step."""
  language, every, true_law = chain
  schedule = schedules.get_schedule("linear")
  distance = {
    steps: 0.5 * np.abs(_exact_sampler_law(language, every, schedule, steps) - true_law).sum()
    for steps in (4, 16, 64, 256)
  }
  assert distance[4] > distance[16] > distance[64] > distance[256], distance
  assert distance[256] < distance[4] / 20, distance


@pytest.mark.parametrize("schedule_name", ["linear", "cosine"])
def test_ancestral_draws_its_exact_law(chain, schedule_name):
  language, every, _ = chain
  tokens, info = _sample(language, 20000, 16, schedule=schedule_name)
  assert int(info["nfe"]) == 16
  law = _exact_sampler_law(language, every, schedules.get_schedule(schedule_name), 16)
  assert _chi_square_p(_counts(tokens), law) > P_VALUE


def test_ancestral_with_many_steps_draws_the_chain(chain):
  """At T = 512 the sampler's distance to the chain is ~2e-3 (the test above): undetectable at
  10,000 draws, so the draws pass a chi-square test against the true law itself."""
  language, _, true_law = chain
  tokens, _ = _sample(language, 10000, 512, key=1)
  assert _chi_square_p(_counts(tokens), true_law) > P_VALUE


def test_greedy_tail_takes_the_most_probable_token_at_the_last_step(chain):
  language, _, _ = chain
  oracle = language.uniform_denoise_fn()
  calls = []

  def recording(z, alpha):
    calls.append((z, alpha))
    return oracle(z, alpha)

  def greedy():
    return md4jax.sample(
      jax.random.PRNGKey(2),
      recording,
      batch_size=64,
      length=LENGTH,
      schedule="linear",
      num_steps=8,
      process="uniform",
      method="greedy_tail",
    )[0]

  tokens = greedy()
  ancestral, _ = _sample(language, 64, 8, key=2)
  # A traced call records tracers: replay the last step's input from an eager run instead.
  with jax.disable_jit():
    calls.clear()
    eager = greedy()
  last_z, last_alpha = calls[-1]
  np.testing.assert_array_equal(eager, tokens)
  np.testing.assert_array_equal(tokens, np.argmax(oracle(last_z, last_alpha), -1))
  assert not np.array_equal(tokens, ancestral)  # The tail differs from a draw somewhere.


@pytest.mark.parametrize("method", ["ancestral", "greedy_tail", "canvas"])
def test_a_row_is_the_same_at_any_batch_size_and_keeps_its_prompt(chain, method):
  language, _, _ = chain
  prompt = jnp.array([2, 0])
  editable = jnp.broadcast_to(jnp.arange(LENGTH) >= 2, (8, LENGTH))
  big, _ = _sample(language, 8, 6, key=3, method=method, prompt=prompt, editable=editable)
  small, _ = _sample(language, 2, 6, key=3, method=method, prompt=prompt, editable=editable[:2])
  np.testing.assert_array_equal(big[:2], small)
  assert np.all(big[:, :2] == [2, 0])
  assert big.min() >= 0 and big.max() < VOCAB


def test_canvas_keeps_more_positions_as_alpha_grows(chain):
  """Canvas refinement is a heuristic: its law is not asserted, only that it ends clean (s = 0
  keeps every position) and that with one step it is one draw per position from μ."""
  language, every, _ = chain
  tokens, info = _sample(language, 20000, 1, key=4, method="canvas")
  assert int(info["nfe"]) == 1
  # One step from uniform noise at α(1) = 0: every position drawn from p(x_ℓ), the marginal.
  marginal = np.asarray(language.initial)
  for position in range(LENGTH):
    counts = np.bincount(tokens[:, position], minlength=VOCAB)
    assert stats.chisquare(counts, marginal * counts.sum()).pvalue > P_VALUE


def test_canvas_keeps_the_schedules_share_of_its_most_confident_positions():
  """T = 4 on the linear schedule: after the step to s, round(α(s) · n) positions hold the
  estimate, the most confident first. A stub denoiser is sure of token 0 at even positions
  (confidence 1) and splits {0, 1} at odd ones (0.5): the kept are the even positions, then the
  odd ones in order (ties keep their order); V = 1000, so a redrawn position is rarely 0 or 1."""
  vocab, length, rows = 1000, 64, 4
  seen = []

  def denoise_fn(z, alpha):
    jax.debug.callback(lambda z: seen.append(np.asarray(z)), z)
    even = (jnp.arange(length) % 2 == 0)[None, :, None]
    allowed = jnp.arange(vocab) < jnp.where(even, 1, 2)
    return jnp.broadcast_to(jnp.where(allowed, 0.0, -jnp.inf), (*z.shape, vocab))

  md4jax.sample(
    jax.random.PRNGKey(5),
    denoise_fn,
    batch_size=rows,
    length=length,
    schedule="linear",
    num_steps=4,
    process="uniform",
    method="canvas",
  )
  assert len(seen) == 4
  by_confidence = [*range(0, length, 2), *range(1, length, 2)]
  for state, keep in zip(seen[1:], (16, 32, 48)):  # The states after s = 0.75, 0.5, 0.25.
    kept, rest = by_confidence[:keep], by_confidence[keep:]
    assert np.all(np.isin(state[:, kept], (0, 1))), keep
    assert np.all(state[:, [p for p in kept if p % 2 == 0]] == 0)
    assert np.isin(state[:, rest], (0, 1)).sum() <= 2  # Redrawn over 1000 tokens.


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(method="confidence"), "masked-process sampler"),
    (dict(cache="prefix"), "cache 'none' or 'exact'"),
    (dict(cache="exact"), "a network's keys and values"),
    (dict(mask_id=3), "mask_id=None only"),
    (dict(block_size=0), "block_size >= 1"),
    (dict(eos_id=1), "eos_id=None only"),
    (dict(num_steps=None), "num_steps >= 1"),
  ],
)
def test_masked_only_options_are_refused_in_one_line(chain, kwargs, message):
  language, _, _ = chain
  settings = dict(num_steps=4) | kwargs
  with pytest.raises(ValueError, match=message):
    md4jax.sample(
      jax.random.PRNGKey(0),
      language.uniform_denoise_fn(),
      batch_size=2,
      length=LENGTH,
      schedule="linear",
      process="uniform",
      **settings,
    )


def test_a_prompt_id_outside_the_vocabulary_is_refused(chain):
  language, _, _ = chain
  with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 3\)"):
    _sample(language, 2, 4, prompt=jnp.array([1, VOCAB]))


def test_an_unknown_process_is_refused():
  with pytest.raises(ValueError, match="unknown process"):
    md4jax.sample(
      jax.random.PRNGKey(0),
      lambda z, a: None,
      batch_size=2,
      length=4,
      schedule="linear",
      mask_id=3,
      process="gaussian",
    )
