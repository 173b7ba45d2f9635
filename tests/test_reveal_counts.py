"""Method "confidence"'s reveal counts and confidences against LLaDA's and Dream's generation
loops: LLaDA's even split of the masks over the steps (get_num_transfer_tokens) ranked by the
plain probability of the drawn token (low_confidence), Dream's float32 share 1 − s/t of the masks
left (diffusion_generate) ranked by the drawn token's filtered probability (maskgit_plus); the
schedule's rule is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md4jax
from md4jax.diffusion import schedules
from md4jax.sampling import categorical, samplers, unmasking

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 12
LINEAR = schedules.get_schedule("linear")

# Dream's counts as torch 2.13 (CPU) computes them, for n masks and T steps: its loop with
# timesteps = torch.linspace(1, 1e-3, T + 1) and int(num_mask_token * (1 - s / t)). The last
# four are where float64 arithmetic, or a linspace rounded twice, gives other counts.
TORCH_DREAM = {
  (12, 5): [2, 2, 2, 2, 4],
  (12, 16): [0, 0, 0, 0, 0] + [1] * 10 + [2],
  (7, 3): [2, 2, 3],
  (64, 64): [0] + [1] * 62 + [2],
  (100, 10): [9] + [10] * 8 + [11],
  (5, 128): [0] * 124 + [1, 1, 1, 2],
  (256, 33): [7] * 9 + [8] * 23 + [9],
  (30, 1): [30],
  (1000, 3): [333, 333, 334],
  (994, 9): [110] * 7 + [111, 113],
  (970, 37): [26] * 31 + [27] * 5 + [29],
  (971, 37): [26] * 29 + [27, 26] + [27] * 5 + [29],
}
# torch.linspace(1, 1e-3, 9) and the bits of the first values of torch.linspace(1, 1e-3, 65).
TORCH_LINSPACE_9 = [1.0, 0.875125, 0.75025, 0.625375, 0.5005, 0.375625, 0.25075, 0.125875, 0.001]
TORCH_LINSPACE_65_BITS = [1065353216, 1065091334, 1064829452, 1064567570, 1064305689, 1064043807]


def llada_counts(n, steps):
  """LLaDA's get_num_transfer_tokens for a row with n masks."""
  base, remainder = divmod(n, steps)
  return [base + (1 if i < remainder else 0) for i in range(steps)]


def torch_linspace(start, end, num):
  """torch.linspace in float32: the products are exact in float64 and so are the sums (they
  span fewer than 53 bits), so casting to float32 rounds once, as the kernel's fused
  multiply-add does."""
  start, end = np.float32(start), np.float32(end)
  step = np.float32(end - start) / np.float32(num - 1)
  values = [
    float(start) + float(step) * i if i < num // 2 else float(end) - float(step) * (num - 1 - i)
    for i in range(num)
  ]
  return np.asarray(values, np.float64).astype(np.float32)


def dream_counts(n, steps):
  """Dream's diffusion_generate: int(n_i · (1 − s/t)) in float32, everything left at the end."""
  times = torch_linspace(1.0, 1e-3, steps + 1)
  counts, left = [], n
  for i in range(steps):
    share = np.float32(1.0) - np.float32(times[i + 1] / times[i])
    count = left if i == steps - 1 else int(np.float32(left) * share)
    counts.append(count)
    left -= count
  return counts


PAIRS = [(1, 1), (3, 8), (8, 3), (12, 5), (12, 12), (12, 16), (7, 3), (100, 7), (255, 64)]


def test_the_formulas_are_llada_and_dreams():
  for (n, steps), counts in TORCH_DREAM.items():
    assert dream_counts(n, steps) == counts, (n, steps)
  assert llada_counts(7, 3) == [3, 2, 2] and llada_counts(2, 5) == [1, 1, 0, 0, 0]
  np.testing.assert_allclose(torch_linspace(1, 1e-3, 9), TORCH_LINSPACE_9, rtol=1e-6)
  bits = unmasking.torch_linspace_float32(1.0, 1e-3, 65).view(np.int32)
  assert bits[:6].tolist() == TORCH_LINSPACE_65_BITS
  for num in (2, 3, 9, 17, 65, 129, 1001):
    np.testing.assert_array_equal(
      unmasking.torch_linspace_float32(1.0, 1e-3, num).view(np.int32),
      torch_linspace(1.0, 1e-3, num).view(np.int32),
    )


def _counts(rule, n, steps):
  """unmasking.reveal_count step after step, for one row that starts with n masks."""
  factors = unmasking.proportional_factors(steps) if rule == "proportional" else None
  counts, left = [], n
  for i in range(steps):
    count = unmasking.reveal_count(
      rule, jnp.int32(i), steps, jnp.int32(left), jnp.int32(n), factors=factors
    )
    counts.append(int(count))
    left -= int(count)
  return counts


@pytest.mark.parametrize("n,steps", PAIRS + list(TORCH_DREAM))
def test_reveal_count_is_the_formula(n, steps):
  assert _counts("even", n, steps) == llada_counts(n, steps)
  assert _counts("proportional", n, steps) == dream_counts(n, steps)


def _denoise(z, alpha):
  """A deterministic, time-free denoiser that reads the whole row."""
  del alpha
  vocab = jnp.arange(VOCAB)[None, None, :]
  position = jnp.arange(z.shape[1])[None, :, None]
  context = jnp.sum(jnp.where(z == MASK_ID, 0.0, z + 1.0), axis=1)[:, None, None]
  return 3.0 * jnp.sin(1.3 * vocab + 0.7 * z[..., None] + 0.37 * position + 0.1 * context)


def _run(key=None, **kwargs):
  key = jax.random.PRNGKey(4) if key is None else key
  settings = dict(
    batch_size=4,
    length=LENGTH,
    schedule=LINEAR,
    mask_id=MASK_ID,
    method="confidence",
    record_trajectory=True,
  )
  tokens, info = md4jax.sample(key, _denoise, **{**settings, **kwargs})
  return np.asarray(tokens), info


def _given(batch_size=4):
  """Rows with 0, 3, 6 and 9 given positions: n = 12, 9, 6, 3 masks."""
  given = np.zeros((batch_size, LENGTH), bool)
  for row in range(batch_size):
    given[row, : 3 * row] = True
  return np.where(given, 1, MASK_ID).astype(np.int32), given


@pytest.mark.parametrize("steps", [1, 4, 5, 16])
@pytest.mark.parametrize("rule", ["even", "proportional"])
def test_a_run_reveals_the_counts(rule, steps):
  """Masks per row after each call: each row's own n (LLaDA counts per row); a step that reveals
  nothing still calls the network under Dream's rule, and LLaDA's are all done after min(T, n)."""
  prompt, given = _given()
  _, info = _run(num_steps=steps, reveal_counts=rule, prompt=prompt, prompt_mask=given)
  masks = (np.asarray(info["trajectory"]["tokens"]) == MASK_ID).sum(-1)  # [S + 1, B]
  formula = llada_counts if rule == "even" else dream_counts
  for row, n in enumerate((~given).sum(-1)):
    revealed = -np.diff(masks[:, row])
    counts = formula(int(n), steps)
    np.testing.assert_array_equal(revealed[: len(counts)], counts[: len(revealed)])
    assert masks[-1, row] == 0
  expected_calls = steps if rule == "proportional" else min(steps, 12)
  assert int(info["nfe"]) == expected_calls
  assert masks.shape[0] - 1 == samplers.max_calls("confidence", LENGTH, steps, 0, rule)


def test_the_schedule_rule_is_the_default_and_unchanged():
  default, info = _run(num_steps=5)
  schedule, _ = _run(num_steps=5, reveal_counts="schedule")
  np.testing.assert_array_equal(default, schedule)
  # floor(12 · λ(t_{s−1}) / λ(1)) masks stay after step s of 5 on the linear schedule.
  masks = (np.asarray(info["trajectory"]["tokens"]) == MASK_ID).sum(-1)
  np.testing.assert_array_equal(masks, np.tile([[12], [9], [7], [4], [2], [0]], (1, 4)))


def _reference(key, steps, counts_of, confidence_of, temperature, top_p=None):
  """LLaDA's / Dream's loop in NumPy for one block of 4 rows from all masks, drawing x0 as
  md4jax does (row r from fold_in(key, r), step i from fold_in(that, T − i)): every masked
  position of a row is ranked by confidence_of(logits, x0) and the counts_of(n, T) best (the
  lower position first on equal scores) take their x0. The states after each step."""
  z = np.full((4, LENGTH), MASK_ID, np.int32)
  n = (z == MASK_ID).sum(-1)
  plans = [counts_of(int(row_n), steps) for row_n in n]
  states = [z.copy()]
  for i in range(steps):
    logits = _denoise(jnp.asarray(z), jnp.zeros(4))
    for row in range(4):
      step_key = jax.random.fold_in(jax.random.fold_in(key, row), steps - i)
      x0 = np.asarray(
        categorical.sample_categorical(step_key, logits[row], temperature=temperature, top_p=top_p)
      )
      score = np.where(z[row] == MASK_ID, confidence_of(logits[row], x0), -np.inf)
      best = np.argsort(-score, kind="stable")[: plans[row][i]]
      z[row, best] = x0[best]
    states.append(z.copy())
  return np.stack(states)


def _prob_of(probs, x0):
  return np.take_along_axis(np.asarray(probs), x0[:, None], axis=-1)[:, 0]


def test_llada_low_confidence_with_even_counts():
  key, steps, temperature = jax.random.PRNGKey(5), 5, 0.7
  _, info = _run(
    key, num_steps=steps, temperature=temperature, confidence="drawn_prob", reveal_counts="even"
  )
  expected = _reference(
    key,
    steps,
    llada_counts,
    lambda logits, x0: _prob_of(jax.nn.softmax(logits, -1), x0),  # Untempered.
    temperature,
  )
  np.testing.assert_array_equal(np.asarray(info["trajectory"]["tokens"]), expected)


def test_dream_maskgit_plus_with_proportional_counts():
  key, steps, temperature, top_p = jax.random.PRNGKey(6), 6, 0.7, 0.9
  _, info = _run(
    key,
    num_steps=steps,
    temperature=temperature,
    top_p=top_p,
    confidence="drawn_filtered_prob",
    reveal_counts="proportional",
  )
  filtered = lambda logits: categorical.filter_logits(logits, temperature=temperature, top_p=top_p)
  expected = _reference(
    key,
    steps,
    dream_counts,
    lambda logits, x0: _prob_of(jax.nn.softmax(filtered(logits), -1), x0),
    temperature,
    top_p,
  )
  np.testing.assert_array_equal(np.asarray(info["trajectory"]["tokens"]), expected)


def test_drawn_confidences_at_temperature_zero_are_max_prob():
  greedy = [
    _run(num_steps=4, temperature=0.0, confidence=kind)[0]
    for kind in ("max_prob", "drawn_prob", "drawn_filtered_prob")
  ]
  np.testing.assert_array_equal(greedy[1], greedy[0])
  np.testing.assert_array_equal(greedy[2], greedy[0])


def test_bad_reveal_counts_are_refused():
  with pytest.raises(ValueError, match="reveal_counts='thirds' is unknown; valid reveal counts"):
    _run(num_steps=4, reveal_counts="thirds")
  with pytest.raises(ValueError, match="applies to method='confidence' only"):
    _run(num_steps=4, method="ancestral", reveal_counts="even")
