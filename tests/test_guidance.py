"""Classifier-free guidance against an exact conditional oracle: a chain whose first tokens are
the prompt, so p(response | prompt) and p(response) are both known exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import groundtruth, schedules
from md4jax.sampling import decoder, samplers

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 8
PROMPT_LENGTH = 2


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=3, concentration=0.3)


def _responses(
  language, scale, prompt, method="first_hitting", num_steps=None, seed=0, n=4000, blocks=False
):
  """Guided draws given prompt's first PROMPT_LENGTH tokens; blocks: by block diffusion's
  sampler, in blocks of PROMPT_LENGTH tokens (the prompt is the first block)."""
  if blocks:
    return decoder.sample(
      jax.random.PRNGKey(seed),
      language.denoise_fn(MASK_ID),
      batch_size=n,
      length=LENGTH,
      block_size=PROMPT_LENGTH,
      mask_id=MASK_ID,
      schedule=schedules.get_schedule("linear"),
      method=method,
      num_steps=num_steps,
      prompt=prompt[:PROMPT_LENGTH],
      guidance_scale=scale,
    )
  given = jnp.arange(LENGTH) < PROMPT_LENGTH
  run = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=n,
      length=LENGTH,
      mask_id=MASK_ID,
      schedule=schedules.get_schedule("linear"),
      method=method,
      num_steps=num_steps,
      prompt=jnp.where(given, prompt, MASK_ID),
      prompt_mask=given,
      guidance_scale=scale,
    )
  )
  tokens, info = run(jax.random.PRNGKey(seed))
  return np.asarray(tokens), info


def _pointwise_mutual_information(language, tokens):
  """log p(response | prompt) − log p(response), per sample: the chain's first response token
  given the prompt's last, against its stationary marginal (the rest cancels)."""
  last, first = tokens[:, PROMPT_LENGTH - 1], tokens[:, PROMPT_LENGTH]
  return np.log(language.transition[last, first]) - np.log(language.initial[first])


def test_scale_zero_is_the_conditional_model_bit_for_bit(language):
  prompt = jnp.array([1, 4] + [0] * (LENGTH - 2))
  plain, _ = _responses(language, 0.0, prompt, n=64)
  given = jnp.arange(LENGTH) < PROMPT_LENGTH
  unguided = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=64,
      length=LENGTH,
      mask_id=MASK_ID,
      schedule=schedules.get_schedule("linear"),
      method="first_hitting",
      prompt=jnp.where(given, prompt, MASK_ID),
      prompt_mask=given,
    )
  )(jax.random.PRNGKey(0))[0]
  np.testing.assert_array_equal(plain, np.asarray(unguided))


@pytest.mark.parametrize("blocks", [False, True], ids=["sample", "block_diffusion"])
def test_guidance_sharpens_the_law_towards_the_prompt(language, blocks):
  # Without guidance the exact sampler draws p(response | prompt): the mean pointwise mutual
  # information is its exact expectation. Guidance draws ∝ p(x | c)^(1+w) / p(x)^w per
  # position, which raises it with w. Block by block, the unconditional call masks the prompt
  # in the earlier blocks it reads.
  prompt_token = int(np.argmax(language.initial))
  prompt = jnp.array([0, prompt_token] + [0] * (LENGTH - 2))
  row = language.transition[prompt_token]
  exact = float(np.sum(row * (np.log(row) - np.log(language.initial))))
  means = []
  for scale in (0.0, 1.0, 3.0):
    tokens, info = _responses(language, scale, prompt, blocks=blocks)
    tokens = np.asarray(tokens)
    assert int(info["nfe"]) <= LENGTH and not np.any(tokens == MASK_ID)
    assert np.all(tokens[:, :PROMPT_LENGTH] == [0, prompt_token])
    pmi = _pointwise_mutual_information(language, tokens)
    means.append((pmi.mean(), pmi.std(ddof=1) / np.sqrt(pmi.size)))
  assert abs(means[0][0] - exact) < 4 * means[0][1], (means[0], exact)
  for (low, low_se), (high, high_se) in zip(means, means[1:]):
    assert high - low > 4 * np.hypot(low_se, high_se), means


@pytest.mark.parametrize(
  "method,num_steps",
  [("ancestral", 16), ("jump", 16), ("confidence", 8), ("threshold", None), ("remdm", 16)],
)
def test_guidance_works_with_every_sampler(language, method, num_steps):
  prompt = jnp.array([2, 5] + [0] * (LENGTH - 2))
  given = jnp.arange(LENGTH) < PROMPT_LENGTH
  tokens, info = decoder.sample(
    jax.random.PRNGKey(1),
    language.denoise_fn(MASK_ID),
    batch_size=32,
    length=LENGTH,
    mask_id=MASK_ID,
    schedule=schedules.get_schedule("linear"),
    method=method,
    num_steps=num_steps,
    threshold=0.9 if method == "threshold" else None,
    prompt=jnp.where(given, prompt, MASK_ID),
    prompt_mask=given,
    guidance_scale=2.0,
  )
  tokens = np.asarray(tokens)
  assert np.all(tokens[:, :2] == [2, 5]) and tokens.max() < VOCAB
  assert int(info["nfe"]) <= samplers.max_calls(method, LENGTH, num_steps)


def test_one_block_of_block_diffusion_guides_as_sample_does(language):
  prompt = jnp.array([3, 1] + [0] * (LENGTH - 2))
  common = dict(batch_size=64, length=LENGTH, mask_id=MASK_ID, guidance_scale=2.0)
  common.update(schedule=schedules.get_schedule("linear"), method="ancestral", num_steps=5)
  blocks, _ = decoder.sample(
    jax.random.PRNGKey(2),
    language.denoise_fn(MASK_ID),
    block_size=LENGTH,
    prompt=prompt[:PROMPT_LENGTH],
    **common,
  )
  given = jnp.arange(LENGTH) < PROMPT_LENGTH
  whole, _ = decoder.sample(
    jax.random.PRNGKey(2),  # One block draws with the key itself.
    language.denoise_fn(MASK_ID),
    prompt=jnp.where(given, prompt, MASK_ID),
    prompt_mask=given,
    **common,
  )
  np.testing.assert_array_equal(np.asarray(blocks), np.asarray(whole))


def test_guidance_needs_a_prompt(language):
  with pytest.raises(ValueError, match="guidance_scale needs a prompt"):
    decoder.sample(
      jax.random.PRNGKey(0),
      language.denoise_fn(MASK_ID),
      batch_size=2,
      length=LENGTH,
      mask_id=MASK_ID,
      schedule=schedules.get_schedule("linear"),
      method="first_hitting",
      guidance_scale=1.0,
    )


def test_guidance_past_the_context_fades_once_the_prompt_leaves_the_window(language):
  # Each block's unconditional call masks the prompt positions in its window: once the prompt
  # has slid out of the window, cond and uncond are one call, and guidance changes nothing.
  common = dict(
    batch_size=32,
    length=4 * LENGTH,
    context_length=LENGTH,
    block_size=LENGTH // 2,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    prompt=jnp.asarray([1, 2]),
    method="first_hitting",
  )
  oracle = language.denoise_fn(MASK_ID)
  guided, _ = decoder.sample(jax.random.PRNGKey(0), oracle, guidance_scale=1.0, **common)
  plain, _ = decoder.sample(jax.random.PRNGKey(0), oracle, **common)
  guided, plain = np.asarray(guided), np.asarray(plain)
  # Blocks 0 and 1 read windows holding the prompt; block 2's window (positions 4..11) does not.
  # On the same keys, a row whose first two blocks guidance left alone is the same row.
  same_start = np.all(guided[:, :LENGTH] == plain[:, :LENGTH], axis=1)
  assert same_start.any() and not same_start.all()
  np.testing.assert_array_equal(guided[same_start], plain[same_start])


def test_the_guided_call_is_the_exact_tilted_law(language):
  # With the exact denoiser, a guided call at the first response position (everything after
  # the prompt masked) gives p(x | prompt)^(1+w) / p(x)^w, renormalized: the chain's transition
  # from the prompt's last token against the position's exact marginal.
  scale, prompt = 1.5, jnp.array([[0, 4] + [MASK_ID] * (LENGTH - 2)])
  given = jnp.arange(LENGTH) < PROMPT_LENGTH
  both = language.denoise_fn(MASK_ID)(*samplers.with_prompt_masked(prompt, 0.5, given, MASK_ID))
  guided = jax.nn.softmax(samplers.mix_guidance(both, scale)[0, PROMPT_LENGTH])
  marginal = language.initial @ np.linalg.matrix_power(language.transition, PROMPT_LENGTH)
  tilted = language.transition[4] ** (1 + scale) / marginal**scale
  np.testing.assert_allclose(guided, tilted / tilted.sum(), rtol=1e-4, atol=1e-7)
