"""ReMDM remasking against the exact Markov ground truth: η = 0 is ancestral, and small σ per step
draws the true chain, on the grid and in the loop at a fixed α."""

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from md4jax.diffusion import groundtruth, schedules
from md4jax.sampling import decoder

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 12


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=0)


def _sample(language, batch_size, num_steps, seed=0, jit=True, **kwargs):
  run = lambda key: decoder.sample(
    key,
    language.denoise_fn(MASK_ID),
    batch_size=batch_size,
    length=LENGTH,
    mask_id=MASK_ID,
    schedule=schedules.get_schedule("linear"),
    num_steps=num_steps,
    **kwargs,
  )
  tokens, info = (jax.jit(run) if jit else run)(jax.random.PRNGKey(seed))
  return np.asarray(tokens), info


@pytest.mark.parametrize("remask", ["cap", "rescale"])
def test_eta_zero_is_ancestral_token_for_token(language, remask):
  ancestral, _ = _sample(language, 64, 32, method="ancestral")
  remdm, info = _sample(language, 64, 32, method="remdm", remask=remask, remask_eta=0.0)
  np.testing.assert_array_equal(remdm, ancestral)
  assert int(info["nfe"]) == 32


@pytest.mark.parametrize(
  "remask,eta,num_steps",
  [pytest.param("cap", 0.01, 256, marks=pytest.mark.slow), ("rescale", 0.05, 512)],
)
def test_remasking_with_small_steps_draws_the_true_chain(language, remask, eta, num_steps):
  # Each step changes few tokens, so the denoiser's per-position marginals are exact enough,
  # and a token masked again is drawn again from the exact conditional: samples follow the chain.
  # The steps' parallel reveals bias the law by about 1/T: at 128 steps a mean NLL gap of about
  # 0.15 nats (3-4.5 SE over seeds 1-6), so 512 steps keep it well inside the 4 SE bound.
  tokens, info = _sample(
    language, 4000, num_steps, seed=1, method="remdm", remask=remask, remask_eta=eta
  )
  oracles.assert_draws_the_chain(language, tokens, MASK_ID)
  assert int(info["nfe"]) == num_steps


@pytest.mark.parametrize("remask,eta,loop", [("cap", 0.3, 0), ("rescale", 0.5, 0), ("cap", 0.3, 6)])
def test_every_step_keeps_the_forward_mask_rate(language, remask, eta, loop):
  # The remasking posterior's point: after each step the share of masked tokens is the
  # forward process's 1 − α(s) (held during the loop), whatever σ. Each position is masked
  # independently of the others (σ is one number per step), so the count is binomial.
  num_steps, batch_size = 16, 512
  _, info = _sample(
    language,
    batch_size,
    num_steps,
    seed=4,
    method="remdm",
    remask=remask,
    remask_eta=eta,
    remask_loop=loop,
    remask_loop_alpha=0.5,
    record_trajectory=True,
  )
  masked = (np.asarray(info["trajectory"]["tokens"])[1:] == MASK_ID).mean(axis=(1, 2))
  schedule = schedules.get_schedule("linear")
  rates = [float(schedule.mask_prob(k / num_steps)) for k in range(num_steps - 1, -1, -1)]
  if loop:  # Linear: α(t_{k−1}) ≥ 0.5 first after step k* = 9 (s = 8/16); the loop holds 0.5.
    rates = rates[: num_steps - 8] + [0.5] * loop + rates[num_steps - 8 :]
  rates = np.asarray(rates)
  stderr = np.sqrt(rates * (1 - rates) / (batch_size * LENGTH))
  np.testing.assert_array_less(np.abs(masked - rates), 5 * stderr + 1e-9)


def test_the_loop_at_a_fixed_alpha_keeps_the_true_chain(language):
  tokens, info = _sample(
    language,
    4000,
    64,
    seed=2,
    method="remdm",
    remask="cap",
    remask_eta=0.02,
    remask_loop=32,
    remask_loop_alpha=0.5,
  )
  oracles.assert_draws_the_chain(language, tokens, MASK_ID)
  assert int(info["nfe"]) == 64 + 32


def test_tokens_are_remasked_but_prompts_never(language):
  prompt = jnp.full((LENGTH,), MASK_ID).at[0].set(2).at[LENGTH - 1].set(4)
  _, info = _sample(
    language,
    8,
    24,
    method="remdm",
    remask="rescale",
    remask_eta=0.5,
    prompt=prompt,
    record_trajectory=True,
    remask_loop=8,
  )
  states = np.asarray(info["trajectory"]["tokens"])  # [S + 1, B, L]
  assert states.shape[0] == 24 + 8 + 1
  remasked = (states[:-1] != MASK_ID) & (states[1:] == MASK_ID)
  assert remasked.any(), "η = 0.5 remasked nothing"
  assert np.all(states[:, :, 0] == 2) and np.all(states[:, :, -1] == 4)
  assert not np.any(states[-1] == MASK_ID)


def test_confidence_remasks_the_least_confident_and_ends_clean(language):
  tokens, info = _sample(
    language, 256, 32, method="remdm", remask="confidence", record_trajectory=True
  )
  states = np.asarray(info["trajectory"]["tokens"])
  assert ((states[:-1] != MASK_ID) & (states[1:] == MASK_ID)).any()
  assert not np.any(tokens == MASK_ID) and tokens.max() < VOCAB


def test_remask_arguments_are_checked(language):
  with pytest.raises(ValueError, match="remask='always' is unknown"):
    _sample(language, 2, 8, jit=False, method="remdm", remask="always")
  with pytest.raises(ValueError, match=r"remask_eta must be in \[0, 1\]"):
    _sample(language, 2, 8, jit=False, method="remdm", remask_eta=1.5)
