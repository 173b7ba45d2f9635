"""configs/dream.py and configs/llada.py sample as their comments say: Dream's whole sample one
block with as many steps as tokens (one a step, as Dream's steps = max_new_tokens), LLaDA's blocks
of 32 after the prompt, 32 steps each (one a step)."""

import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.app import generate
from md4jax.sampling import unmasking
from md4jax.training import state as state_lib


def _preset(name):
  config = config_lib.load_config(name)
  config.data.path = "pairs.jsonl"
  config_lib.validate_config(config, num_devices=4, platform="tpu")
  return config


def _counts(rule, num_steps, masked):
  """The reveals of each step of one block of `masked` masks (`unmasking.reveal_count`)."""
  factors = unmasking.proportional_factors(num_steps) if rule == "proportional" else None
  initial = np.asarray([masked], np.int32)
  left, counts = initial, []
  for i in range(num_steps):
    count = int(unmasking.reveal_count(rule, i, num_steps, left, initial, factors=factors)[0])
    counts.append(count)
    left = left - count
  assert int(left[0]) == 0
  return counts


def test_dream_reveals_one_token_a_step_of_one_block():
  config = _preset("dream")
  length = generate.settings(config)["length"]
  how = generate.decoding(config, state_lib.build_model(config), length)
  assert how["block_size"] is None and how["cache"] == "none"  # One block: the whole sample.
  assert length <= config.data.seq_len and config.sample.num_steps == length
  counts = _counts("proportional", config.sample.num_steps, length)
  # Dream's counts: none on the first step, two on the last, one on every other.
  assert counts[0] == 0 and counts[-1] == 2 and set(counts[1:-1]) == {1}


def test_llada_reveals_one_token_a_step_of_each_block():
  config = _preset("llada")
  how = generate.decoding(config, state_lib.build_model(config), config.data.seq_len)
  assert how["block_size"] == config.sample.block_length == config.sample.num_steps == 32
  assert _counts("even", config.sample.num_steps, how["block_size"]) == [1] * 32


@pytest.mark.parametrize("name", ["dream", "llada"])
def test_the_released_mask_id_lies_inside_the_preset_vocabulary(name):
  config = _preset(name)
  assert 0 <= config.model.checkpoint_mask_id < config.data.vocab_size
