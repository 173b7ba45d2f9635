"""md4jax.posttraining.rollouts: which positions a rollout keeps, generates and is scored on."""

import jax.numpy as jnp
import numpy as np

from md4jax.posttraining import rollouts


def test_a_conditional_row_keeps_its_prompt_and_generates_to_its_eos():
  batch = {  # Prompt 5 6, answer 7 and EOS 9, then padding.
    "tokens": jnp.array([[5, 6, 7, 9, 0, 0]]),
    "segment_ids": jnp.array([[1, 1, 1, 1, 0, 0]]),
    "positions": jnp.array([[0, 1, 2, 3, 0, 0]]),
    "editable": jnp.array([[False, False, True, True, False, False]]),
  }
  grouped = rollouts.grouped(batch, 3)
  assert grouped["tokens"].shape == (3, 6)
  np.testing.assert_array_equal(grouped["segment_ids"], np.repeat(batch["segment_ids"], 3, 0))
  fixed = rollouts.prompt_mask(grouped)
  np.testing.assert_array_equal(fixed[0], [True, True, False, False, False, False])
  # The sampler's lengths: the first rollout's EOS at 3 (length 4), the second never ended.
  span = rollouts.generated_span(fixed, jnp.array([4, 6, 3]))
  np.testing.assert_array_equal(span[0], [False, False, True, True, False, False])
  np.testing.assert_array_equal(span[1], [False, False, True, True, True, True])
  np.testing.assert_array_equal(span[2], [False, False, True, False, False, False])
  segment_ids, positions = rollouts.scored_inputs(fixed, span)
  np.testing.assert_array_equal(segment_ids[0], [1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(positions[0], [0, 1, 2, 3, 0, 0])


def test_a_dense_row_is_an_unprompted_rollout():
  batch = {
    "tokens": jnp.zeros((2, 4), jnp.int32),
    "segment_ids": None,
    "positions": None,
    "editable": jnp.ones((2, 4), bool),
  }
  grouped = rollouts.grouped(batch, 2)
  assert grouped["segment_ids"] is None and grouped["tokens"].shape == (4, 4)
  fixed = rollouts.prompt_mask(grouped)
  assert not fixed.any()
  assert rollouts.generated_span(fixed, None).all()


def test_a_bigram_reward_counts_the_pairs_ending_in_a_generated_token(tmp_path):
  from md4jax.posttraining import rewards  # pylint: disable=g-import-not-at-top

  table = np.arange(9, dtype=np.float64).reshape(3, 3)  # R[a, b] = 3a + b.
  np.save(tmp_path / "r.npy", table)
  reward = rewards.parse(f"bigram:{tmp_path / 'r.npy'}", 3)
  tokens = jnp.array([[2, 0, 1, 2], [1, 1, 1, 1]])
  generated = jnp.array([[False, False, True, True], [True, True, True, True]])
  got = reward({"tokens": tokens, "generated": generated})
  # Row 0: pairs (0, 1) and (1, 2), not the prompt's (2, 0); row 1: all three (1, 1) pairs.
  np.testing.assert_array_equal(np.asarray(got), [1.0 + 5.0, 3 * 4.0])
