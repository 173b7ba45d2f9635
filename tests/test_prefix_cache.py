"""Fast-dLLM's approximate caches in block-wise decoding: exact where the cache cannot be stale,
approximate (and still valid samples) elsewhere, with the refresh calls counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer
from md4jax.sampling import decoder

VOCAB, LENGTH, BLOCK = 6, 16, 4
CACHES = ("none", "prefix", "dual")  # Fast-dLLM's, and the exact decoding they approximate.
MASK_ID = VOCAB


@pytest.fixture(scope="module")
def network():
  model = Transformer(
    vocab_size=VOCAB, num_layers=2, model_dim=32, num_heads=2, mlp_dim=64, weight_init="fan_in"
  )
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, LENGTH), jnp.int32))["params"]
  return model, jax.tree.map(lambda p: 3.0 * p, params)  # Sharper than the init's logits.


def _sample(network, cache, block_size=BLOCK, **kwargs):
  model, params = network
  return decoder.sample(
    jax.random.PRNGKey(1),
    Denoiser.of_network(model, params),
    batch_size=16,
    length=LENGTH,
    block_size=block_size,
    cache=cache,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    prompt=jnp.asarray([1, 2, 3], jnp.int32),
    **kwargs,
  )


def test_one_block_leaves_nothing_to_cache(network):
  tokens = [np.asarray(_sample(network, c, LENGTH, num_steps=4)[0]) for c in CACHES]
  np.testing.assert_array_equal(tokens[1], tokens[0])
  np.testing.assert_array_equal(tokens[2], tokens[0])


def test_dual_cache_is_exact_when_each_block_takes_one_call(network):
  # The one call of each block comes right after the refresh: nothing is stale yet.
  none, none_info = _sample(network, "none", num_steps=1)
  dual, dual_info = _sample(network, "dual", num_steps=1)
  np.testing.assert_array_equal(np.asarray(dual), np.asarray(none))
  assert int(dual_info["nfe"]) == int(none_info["nfe"]) + LENGTH // BLOCK


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_stale_caches_still_sample_valid_tokens(network, cache):
  exact, _ = _sample(network, "none", num_steps=4)
  approximate, info = _sample(network, cache, num_steps=4)
  approximate = np.asarray(approximate)
  assert not np.any(approximate == MASK_ID)
  np.testing.assert_array_equal(approximate[:, :3], np.tile([1, 2, 3], (16, 1)))
  assert int(info["nfe"]) == 4 * (LENGTH // BLOCK) + LENGTH // BLOCK
  assert np.any(approximate != np.asarray(exact))  # Approximate: some token differs.


def test_guided_caches_are_exact_where_they_cannot_be_stale(network):
  # One block: nothing cached; one call a block: nothing stale yet. The prompt-masked rows
  # keep their own cache, so the guided draws match the uncached guided ones exactly.
  model, sharp = network
  network = (model, jax.tree.map(lambda p: p / 3.0, sharp))  # Sharp logits hide guidance.
  for block_size, num_steps in ((LENGTH, 4), (BLOCK, 1)):
    none, _ = _sample(network, "none", block_size, num_steps=num_steps, guidance_scale=2.0)
    dual, _ = _sample(network, "dual", block_size, num_steps=num_steps, guidance_scale=2.0)
    np.testing.assert_array_equal(np.asarray(dual), np.asarray(none))
  unguided, _ = _sample(network, "dual", BLOCK, num_steps=1)
  assert np.any(np.asarray(unguided) != np.asarray(dual))  # Guidance changed the draws.


def test_caching_refuses_networks_it_cannot_serve(network):
  model, params = network
  with pytest.raises(ValueError, match="time-free bidirectional"):
    decoder.sample(
      jax.random.PRNGKey(0),
      Denoiser.of_network(model.clone(time_conditioning="adaln"), params),
      batch_size=2,
      length=LENGTH,
      block_size=BLOCK,
      cache="prefix",
      schedule=schedules.get_schedule("linear"),
      mask_id=MASK_ID,
      num_steps=2,
    )
  with pytest.raises(ValueError, match="Unknown cache"):
    _sample(network, "triple")
