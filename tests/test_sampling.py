"""Samplers against the exact Markov ground truth (statistical tolerances from the sampling error)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from md4jax.diffusion import groundtruth, schedules
from md4jax.sampling import categorical, decoder, samplers

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 12
NUM_SAMPLES = 4000


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=0)


@functools.lru_cache(maxsize=None)
def _samples(language, method, num_steps, schedule_name="linear", batch_size=NUM_SAMPLES, seed=1):
  schedule = schedules.get_schedule(schedule_name)
  run = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=batch_size,
      length=LENGTH,
      schedule=schedule,
      mask_id=MASK_ID,
      method=method,
      num_steps=num_steps,
    )
  )
  tokens, info = run(jax.random.PRNGKey(seed))
  return np.asarray(tokens), int(info["nfe"])


def assert_bigrams_follow_the_chain(language, tokens):
  """Bigram counts (all positions pooled) against the exact transitions: χ², p = 1e-4."""
  vocab = language.vocab_size
  counts = np.zeros((vocab, vocab))
  np.add.at(counts, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
  expected = counts.sum(1, keepdims=True) * language.transition
  keep = expected >= 5
  statistic = np.sum((counts - expected)[keep] ** 2 / expected[keep])
  dof = keep.sum() - vocab
  assert statistic < scipy.stats.chi2.ppf(1 - 1e-4, dof), (statistic, dof)


def _log_prob_gap(language, tokens):
  """(mean −log p(sample) − H, its SE): 0 in expectation for exact samples."""
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  return nll.mean() - language.entropy(LENGTH), nll.std(ddof=1) / np.sqrt(nll.size)


@pytest.mark.parametrize(
  "method,num_steps",
  [
    ("ancestral", 256),
    pytest.param(
      "cached", 256, marks=pytest.mark.slow
    ),  # cached == ancestral, token for token, below.
    ("jump", 1000),
    ("first_hitting", None),
  ],
)
def test_exact_samplers_draw_the_true_distribution(language, method, num_steps):
  tokens, _ = _samples(language, method, num_steps)
  assert not np.any(tokens == MASK_ID)
  gap, se = _log_prob_gap(language, tokens)
  assert abs(gap) < 4 * se, (gap, se)
  assert_bigrams_follow_the_chain(language, tokens)
  # First-position frequencies against the stationary start.
  first = np.bincount(tokens[:, 0], minlength=VOCAB)
  expected_first = language.initial * tokens.shape[0]
  statistic = np.sum((first - expected_first) ** 2 / expected_first)
  assert statistic < scipy.stats.chi2.ppf(1 - 1e-4, VOCAB - 1)


def test_few_steps_show_the_factorization_error_and_it_shrinks(language):
  """One step draws every position independently given all-mask: far from the chain.

  Measured here: excess NLL of about 15 nats at T = 1, 3.6 at T = 4 (vs SE ≈ 0.1).
  """
  gaps = {
    steps: _log_prob_gap(language, _samples(language, "ancestral", steps)[0])
    for steps in [1, 4, 32]
  }
  (gap_1, se_1), (gap_4, se_4), (gap_32, se_32) = gaps[1], gaps[4], gaps[32]
  assert gap_1 > 10 * se_1
  assert gap_1 - gap_4 > 4 * np.hypot(se_1, se_4)
  assert gap_4 - gap_32 > 4 * np.hypot(se_4, se_32)


def _reference_ancestral(key, denoise_fn, batch_size, schedule, num_steps):
  """A plain Python loop of the reverse step, the specification of the jitted sampler: row b
  draws from its own key fold_in(key, b) alone."""
  z = jnp.full((batch_size, LENGTH), MASK_ID, jnp.int32)
  grid = np.arange(num_steps + 1) / num_steps
  row_keys = [jax.random.fold_in(key, b) for b in range(batch_size)]
  for step in range(num_steps, 0, -1):
    rate_t, rate_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
    reveal_prob = 1.0 if step == 1 else (rate_t - rate_s) / rate_t
    logits = denoise_fn(z, jnp.full((batch_size,), schedule.alpha(grid[step]), jnp.float32))
    rows = []
    for b, row_key in enumerate(row_keys):
      reveal_key, draw_key = jax.random.split(jax.random.fold_in(row_key, step))
      reveal = (z[b] == MASK_ID) & (jax.random.uniform(reveal_key, (LENGTH,)) < reveal_prob)
      rows.append(jnp.where(reveal, categorical.sample_categorical(draw_key, logits[b]), z[b]))
    z = jnp.stack(rows)
  return np.asarray(z)


def test_jitted_loop_equals_python_loop(language):
  schedule = schedules.get_schedule("cosine")
  key = jax.random.PRNGKey(5)
  tokens, nfe = jax.jit(
    lambda k: decoder.sample(
      k,
      language.denoise_fn(MASK_ID),
      batch_size=16,
      length=LENGTH,
      schedule=schedule,
      mask_id=MASK_ID,
      num_steps=8,
    )
  )(key)
  np.testing.assert_array_equal(
    tokens, _reference_ancestral(key, language.denoise_fn(MASK_ID), 16, schedule, 8)
  )
  assert int(nfe["nfe"]) == 8


def test_cached_equals_ancestral_with_fewer_calls(language):
  ancestral, ancestral_nfe = _samples(language, "ancestral", 64, batch_size=8, seed=3)
  cached, cached_nfe = _samples(language, "cached", 64, batch_size=8, seed=3)
  np.testing.assert_array_equal(cached, ancestral)
  assert ancestral_nfe == 64
  # NFE ≤ the number of distinct reveal events (steps at which some token was revealed).
  _, info = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=8,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      method="cached",
      num_steps=64,
      record_trajectory=True,
    )
  )(jax.random.PRNGKey(3))
  states = np.asarray(info["trajectory"]["tokens"])
  reveal_events = int(np.sum(np.any(states[1:] != states[:-1], axis=(1, 2))))
  assert int(info["nfe"]) == cached_nfe <= reveal_events < ancestral_nfe


def _recorded_states(language, method, num_steps, prompt=None, prompt_mask=None, **kwargs):
  """Runs a jitted sampler: (every z the network sees, in call order, then the final tokens; info)."""
  states = []
  oracle = language.denoise_fn(MASK_ID)

  def recording(z, alpha):
    jax.debug.callback(lambda value: states.append(np.asarray(value)), z, ordered=True)
    return oracle(z, alpha)

  tokens, info = jax.jit(
    lambda key: decoder.sample(
      key,
      recording,
      batch_size=32,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      method=method,
      num_steps=num_steps,
      prompt=prompt,
      prompt_mask=prompt_mask,
      **kwargs,
    )
  )(jax.random.PRNGKey(2))
  jax.effects_barrier()
  return states + [np.asarray(tokens)], info


@pytest.mark.parametrize(
  "method,num_steps,kwargs",
  [
    ("ancestral", 8, {}),
    ("cached", 8, {}),
    ("jump", 8, {}),
    ("first_hitting", None, {}),
    ("confidence", 6, {}),
    ("threshold", None, {"threshold": 0.8}),
  ],
)
def test_revealed_tokens_never_change_and_prompts_are_clamped(language, method, num_steps, kwargs):
  prompt = jnp.zeros((LENGTH,), jnp.int32).at[3].set(2).at[LENGTH - 1].set(4)
  prompt_mask = jnp.zeros((LENGTH,), bool).at[3].set(True).at[LENGTH - 1].set(True)
  states, _ = _recorded_states(language, method, num_steps, prompt, prompt_mask, **kwargs)
  assert len(states) >= 2
  for before, after in zip(states, states[1:]):
    revealed = before != MASK_ID
    np.testing.assert_array_equal(after[revealed], before[revealed])
  final = states[-1]
  assert not np.any(final == MASK_ID)
  np.testing.assert_array_equal(final[:, 3], 2)
  np.testing.assert_array_equal(final[:, LENGTH - 1], 4)


def _exact_law_gap(language, tokens):
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  return nll.mean() - language.entropy(LENGTH), nll.std(ddof=1) / np.sqrt(nll.size)


@pytest.mark.parametrize("num_steps", [4, 64])
def test_jump_draws_the_ancestral_law_with_fewer_calls(language, num_steps):
  """Same T, same law: the exact-law excess and the bigram counts agree (two-sample tests);
  at T = 4 both are far from the chain (the factorization error), which makes the test sharp."""
  ancestral, ancestral_nfe = _samples(language, "ancestral", num_steps)
  jump, jump_nfe = _samples(language, "jump", num_steps, seed=2)
  (gap_a, se_a), (gap_j, se_j) = _exact_law_gap(language, ancestral), _exact_law_gap(language, jump)
  assert abs(gap_a - gap_j) < 4 * np.hypot(se_a, se_j), (gap_a, gap_j)
  counts = np.zeros((2, VOCAB * VOCAB))
  for row, tokens in enumerate((ancestral, jump)):
    np.add.at(counts[row], tokens[:, :-1].ravel() * VOCAB + tokens[:, 1:].ravel(), 1)
  counts = counts[:, counts.min(0) >= 5]
  statistic, p_value, _, _ = scipy.stats.chi2_contingency(counts)
  assert p_value > 1e-4, (statistic, p_value)
  assert ancestral_nfe == num_steps and jump_nfe <= min(num_steps, LENGTH)


def test_jump_costs_at_most_L_calls_at_any_T(language):
  for num_steps in (1000, 10_000):
    _, nfe = _samples(language, "jump", num_steps, batch_size=64)
    assert nfe <= LENGTH


def test_threshold_reveals_every_confident_position_and_at_least_one():
  threshold = 0.7
  peaked = groundtruth.MarkovLanguage(VOCAB, seed=0, concentration=0.05)  # Confident neighbours.
  _, info = jax.jit(
    lambda key: decoder.sample(
      key,
      peaked.denoise_fn(MASK_ID),
      batch_size=64,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      method="threshold",
      threshold=threshold,
      record_trajectory=True,
      trajectory_top_k=1,
    )
  )(jax.random.PRNGKey(4))
  nfe = int(info["nfe"])
  states = np.asarray(info["trajectory"]["tokens"])
  top = np.asarray(info["trajectory"]["top_probs"])[..., 0]
  assert nfe <= LENGTH
  sequence_calls = 0
  for call in range(nfe):
    before, after = states[call], states[call + 1]
    masked = before == MASK_ID
    revealed = masked & (after != MASK_ID)
    assert np.all(revealed[masked & (top[call] >= threshold)])  # Every confident one.
    active = masked.any(-1)
    sequence_calls += active.sum()
    assert np.all(revealed.sum(-1)[active] >= 1)  # At least one per sequence.
    # Below the threshold, only a sequence's single most confident mask, when none is above.
    below = revealed & (top[call] < threshold)
    assert np.all(below.sum(-1) <= 1)
    assert not np.any(below & (masked & (top[call] >= threshold)).any(-1, keepdims=True))
  assert not np.any(states[nfe] == MASK_ID)
  assert 64 * LENGTH / sequence_calls > 1.5  # Parallel: tokens revealed per sequence and call.


def test_first_hitting_makes_one_call_per_masked_position(language):
  _, nfe = _samples(language, "first_hitting", None, batch_size=8)
  assert nfe == LENGTH


def test_bad_arguments_raise(language):
  kwargs = dict(batch_size=2, length=4, schedule=schedules.get_schedule("linear"), mask_id=MASK_ID)
  oracle = language.denoise_fn(MASK_ID)
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="method=.beam. is unknown"):
    decoder.sample(key, oracle, method="beam", num_steps=4, **kwargs)
  with pytest.raises(ValueError, match="num_steps"):
    decoder.sample(key, oracle, method="ancestral", **kwargs)
  with pytest.raises(ValueError, match="top_p"):
    decoder.sample(key, oracle, num_steps=4, top_p=2.0, **kwargs)
  with pytest.raises(ValueError, match="time grid"):
    decoder.sample(key, oracle, num_steps=4, time_grid_kind="log", **kwargs)
  for method, threshold in (("threshold", None), ("threshold", 1.5), ("ancestral", 0.9)):
    with pytest.raises(ValueError, match=r"needs a threshold in \[0, 1\]"):
      decoder.sample(key, oracle, method=method, num_steps=4, threshold=threshold, **kwargs)


@pytest.mark.parametrize("method,num_steps", [("ancestral", 6), ("first_hitting", None)])
def test_trajectory_records_every_state(language, method, num_steps):
  prompt = jnp.zeros((LENGTH,), jnp.int32).at[0].set(3)
  prompt_mask = jnp.zeros((LENGTH,), bool).at[0].set(True)
  tokens, info = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=4,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      method=method,
      num_steps=num_steps,
      prompt=prompt,
      prompt_mask=prompt_mask,
      record_trajectory=True,
      trajectory_top_k=3,
    )
  )(jax.random.PRNGKey(0))
  trajectory = jax.tree.map(np.asarray, info["trajectory"])
  num_records = LENGTH if method == "first_hitting" else num_steps
  assert trajectory["tokens"].shape == (num_records + 1, 4, LENGTH)
  assert trajectory["top_ids"].shape == trajectory["top_probs"].shape == (num_records, 4, LENGTH, 3)
  np.testing.assert_array_equal(trajectory["tokens"][0, :, 1:], MASK_ID)
  np.testing.assert_array_equal(trajectory["tokens"][:, :, 0], 3)
  np.testing.assert_array_equal(trajectory["tokens"][-1], tokens)
  for before, after in zip(trajectory["tokens"], trajectory["tokens"][1:]):
    revealed = before != MASK_ID
    np.testing.assert_array_equal(after[revealed], before[revealed])
  used = trajectory["top_probs"][: int(info["nfe"])]
  assert np.all(np.diff(used, axis=-1) <= 0) and np.all(used.sum(-1) <= 1 + 1e-5)
  # The recorded candidates are the oracle's: at step 0 every position's top-1 is its argmax.
  oracle_probs = jax.nn.softmax(language.denoise_fn(MASK_ID)(trajectory["tokens"][0], None))
  np.testing.assert_array_equal(trajectory["top_ids"][0, ..., 0], np.argmax(oracle_probs, -1))


def test_semi_autoregressive_generation_samples_the_long_chain(language):
  """An order-1 chain is exactly continued by any clamped prefix, so block-wise
  first-hitting generation of 30 tokens with a 12-token context is exact."""
  total, context, block = 30, LENGTH, 6
  tokens, info = decoder.sample(
    jax.random.PRNGKey(4),
    language.denoise_fn(MASK_ID),
    batch_size=3000,
    length=total,
    context_length=context,
    block_size=block,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method="first_hitting",
  )
  tokens = np.asarray(tokens)
  assert tokens.shape == (3000, total) and not np.any(tokens == MASK_ID)
  assert info["num_blocks"] == -(-total // block)
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  gap, se = nll.mean() - language.entropy(total), nll.std(ddof=1) / np.sqrt(nll.size)
  assert abs(gap) < 4 * se, (gap, se)


def test_semi_autoregressive_prompt_eos_and_lengths(language):
  eos = 2
  oracle = language.denoise_fn(MASK_ID)

  def eos_loving(z, alpha):  # Puts EOS first wherever it is allowed.
    return oracle(z, alpha).at[..., eos].add(5.0)

  prompt = jnp.asarray([1, 0, 1], jnp.int32)
  tokens, info = decoder.sample(
    jax.random.PRNGKey(0),
    eos_loving,
    batch_size=4,
    length=40,
    context_length=8,
    block_size=4,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    prompt=prompt,
    eos_id=eos,
    method="ancestral",
    num_steps=8,
  )
  tokens, lengths = np.asarray(tokens), np.asarray(info["lengths"])
  assert tokens.shape == (4, 40)
  np.testing.assert_array_equal(tokens[:, :3], np.tile(prompt, (4, 1)))
  assert info["num_blocks"] < 40 // 4  # Stopped early: every sequence ended.
  assert info["nfe"] == 8 * info["num_blocks"]
  for row, length in zip(tokens, lengths):
    assert row[length - 1] == eos and eos not in row[3 : length - 1]
    np.testing.assert_array_equal(row[length:], eos)
  with pytest.raises(ValueError, match="block_size"):
    decoder.sample(
      jax.random.PRNGKey(0),
      oracle,
      batch_size=1,
      length=20,
      context_length=8,
      block_size=9,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      num_steps=4,
    )


@pytest.mark.slow
def test_cosine_time_grid_samples_the_chain_exactly(language):
  """The cosine grid puts more steps near t = 0 and, with many steps, is still exact."""
  grid = np.asarray(samplers.time_grid(8, "cosine"))
  assert grid[0] == 0 and grid[-1] == pytest.approx(1.0) and np.all(np.diff(grid) > 0)
  assert np.diff(grid)[0] < 1 / 8 < np.diff(grid)[-1]
  tokens, _ = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=NUM_SAMPLES,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      num_steps=256,
      time_grid_kind="cosine",
    )
  )(jax.random.PRNGKey(9))
  gap, se = _log_prob_gap(language, np.asarray(tokens))
  assert abs(gap) < 4 * se, (gap, se)


# The kinds scored by the law alone; those scored by the token drawn: tests/test_reveal_counts.py.
@pytest.mark.parametrize("confidence", ["max_prob", "margin", "neg_entropy"])
def test_confidence_reveals_the_schedules_share_of_masks_per_step(language, confidence):
  """Linear schedule, T = 4 steps, 12 masks: floor(12·s) stay masked after each step (9, 6, 3, 0),
  and the revealed positions are the most confident ones."""
  _, info = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID),
      batch_size=8,
      length=LENGTH,
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      method="confidence",
      num_steps=4,
      confidence=confidence,
      record_trajectory=True,
    )
  )(jax.random.PRNGKey(1))
  states = np.asarray(info["trajectory"]["tokens"])
  np.testing.assert_array_equal(
    (states == MASK_ID).sum(-1), np.tile([[12], [9], [6], [3], [0]], (1, 8))
  )
  # Step 1 reveals the 3 positions whose oracle distribution scores highest.
  probs = np.asarray(jax.nn.softmax(language.denoise_fn(MASK_ID)(states[0], None)))
  top2 = np.sort(probs, -1)[..., ::-1][..., :2]
  score = {
    "max_prob": top2[..., 0],
    "margin": top2[..., 0] - top2[..., 1],
    "neg_entropy": np.sum(probs * np.log(probs), -1),
  }[confidence]
  revealed = states[1] != MASK_ID
  for row in range(8):
    assert score[row][revealed[row]].min() >= np.sort(score[row])[-3] - 1e-6


def test_confidence_stops_calling_once_nothing_is_masked(language):
  """T = 64 steps for 12 masks: the schedule keeps floor(12·(s−1)/64) masks after step s, so
  every step reveals exactly one (the at-least-one rule) and the batch is done after 12 calls;
  the 52 steps left would change nothing and are not run. Later records repeat the end."""
  states, info = _recorded_states(language, "confidence", 64, record_trajectory=True)
  calls, tokens = states[:-1], states[-1]
  assert int(info["nfe"]) == len(calls) == LENGTH
  np.testing.assert_array_equal(
    (np.stack(states) == MASK_ID).sum(-1), np.tile(np.arange(LENGTH, -1, -1)[:, None], (1, 32))
  )
  recorded = np.asarray(info["trajectory"]["tokens"])
  np.testing.assert_array_equal(recorded[: LENGTH + 1], np.stack(states))
  np.testing.assert_array_equal(recorded[LENGTH:], np.broadcast_to(tokens, recorded[LENGTH:].shape))
