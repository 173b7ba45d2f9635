"""Block diffusion through the block decoder: the exact KV cache draws the window re-run's tokens
bit for bit on the same keys (every method, with a prompt), runs past the context with a sliding
cache, and the window re-run with the exact oracle draws the true chain."""

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from md4jax.diffusion import groundtruth, schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer
from md4jax.sampling import decoder

VOCAB = 6
MASK_ID = VOCAB
BLOCK = 4


@pytest.fixture(scope="module")
def network():
  model = Transformer(
    vocab_size=VOCAB,
    num_layers=2,
    model_dim=32,
    num_heads=2,
    mlp_dim=64,
    block_size=BLOCK,
    weight_init="fan_in",
  )
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
  # Sharper than the init's near-uniform logits, so that the methods' choices differ.
  params = jax.tree.map(lambda p: 3.0 * p, params)
  return model, params


METHODS = [
  ("ancestral", {"num_steps": 4}),
  ("first_hitting", {}),
  ("confidence", {"num_steps": 2}),
  ("threshold", {"threshold": 0.3}),
  ("jump", {"num_steps": 3}),
]


def _prompted(method, **kwargs) -> dict:
  """8 samples of 16 tokens in blocks of BLOCK after a 5-token prompt (it reaches into block 1)."""
  return dict(
    batch_size=8,
    length=16,
    block_size=BLOCK,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method=method,
    prompt=jnp.asarray([1, 2, 3, 4, 5], jnp.int32),
    **kwargs,
  )


@pytest.mark.parametrize("method,kwargs", METHODS, ids=[m for m, _ in METHODS])
def test_cached_tokens_equal_the_reference_bit_for_bit(network, method, kwargs):
  model, params = network
  common = _prompted(method, **kwargs)
  # These sharp logits give nearly every row one of two continuations: a key whose rows draw
  # both (PRNGKey(3)'s eight rows all drew one under ancestral).
  key = jax.random.PRNGKey(0)
  reference, info = decoder.sample(
    key, lambda z, alpha: model.apply({"params": params}, z, alpha), **common
  )
  cached, cached_info = decoder.sample(
    key, Denoiser.of_network(model, params), cache="exact", context_length=16, **common
  )
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))
  assert not np.any(np.asarray(cached) == MASK_ID)
  np.testing.assert_array_equal(np.asarray(cached)[:, :5], np.tile([1, 2, 3, 4, 5], (8, 1)))
  assert int(cached_info["nfe"]) == int(info["nfe"]) and info["num_blocks"] == 4
  assert cached_info["cache_writes"] == 4
  assert cached_info["cache_bytes"] == 2 * 2 * 8 * 12 * 32 * 4  # K, V · layers · B · slots · D · 4.
  if method in ("ancestral", "first_hitting", "jump"):  # The others decode greedily.
    assert len({tuple(row) for row in np.asarray(cached)[:, 5:]}) > 1


@pytest.mark.parametrize("method,kwargs", METHODS[:2], ids=[m for m, _ in METHODS[:2]])
def test_guided_cached_tokens_equal_the_guided_reference(network, method, kwargs):
  # The prompt (5 tokens) fills block 0 and reaches into block 1: the prompt-masked rows' own
  # cache must hold block 0 computed with the prompt masked.
  model, sharp = network
  params = jax.tree.map(lambda p: p / 3.0, sharp)  # The init's: sharp logits hide guidance.
  common = _prompted(method, guidance_scale=1.5, **kwargs)
  key = jax.random.PRNGKey(3)
  reference, _ = decoder.sample(
    key, lambda z, alpha: model.apply({"params": params}, z, alpha), **common
  )
  cached, info = decoder.sample(
    key, Denoiser.of_network(model, params), cache="exact", context_length=16, **common
  )
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))
  assert info["cache_bytes"] == 2 * 2 * 16 * 12 * 32 * 4  # The prompt-masked rows' cache too.
  unguided, _ = decoder.sample(
    key,
    Denoiser.of_network(model, params),
    cache="exact",
    context_length=16,
    **{**common, "guidance_scale": 0.0},
  )
  assert np.any(np.asarray(unguided) != np.asarray(cached))  # Guidance changed the draws.


def test_past_the_context_the_cache_slides(network):
  model, params = network
  common = dict(
    batch_size=4,
    block_size=BLOCK,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method="first_hitting",
  )
  key = jax.random.PRNGKey(5)
  long, info = decoder.sample(
    key, Denoiser.of_network(model, params), cache="exact", length=40, context_length=8, **common
  )
  assert long.shape == (4, 40) and not np.any(np.asarray(long) == MASK_ID)
  assert info["num_blocks"] == 10 and info["cache_bytes"] == 2 * 2 * 4 * 4 * 32 * 4
  # Until the ring wraps (the first two blocks), the window re-run and the cache agree exactly;
  # block 2's window no longer shows block 0, which the cached keys of block 1 were computed with.
  window, _ = decoder.sample(
    key,
    lambda z, alpha: model.apply({"params": params}, z, alpha),
    length=40,
    context_length=8,
    **common,
  )
  np.testing.assert_array_equal(np.asarray(long)[:, :8], np.asarray(window)[:, :8])


def test_a_context_of_one_block_keeps_no_cache(network):
  model, params = network
  tokens, info = decoder.sample(
    jax.random.PRNGKey(0),
    Denoiser.of_network(model, params),
    cache="exact",
    batch_size=2,
    length=10,
    block_size=BLOCK,
    context_length=BLOCK,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method="first_hitting",
  )
  assert tokens.shape == (2, 10) and info["cache_writes"] == 0 and info["cache_bytes"] == 0


def test_bad_shapes_are_refused(network):
  model, params = network
  common = dict(batch_size=2, length=8, schedule=schedules.get_schedule("linear"), mask_id=MASK_ID)
  common.update(denoise_fn=Denoiser.of_network(model, params), cache="exact", num_steps=2)
  with pytest.raises(ValueError, match="multiple of block_size"):
    decoder.sample(jax.random.PRNGKey(0), block_size=BLOCK, context_length=6, **common)
  with pytest.raises(ValueError, match="blocks of 4 tokens"):
    decoder.sample(jax.random.PRNGKey(0), block_size=2, context_length=8, **common)


@pytest.mark.parametrize("block_size,method", [(1, "ancestral"), (4, "first_hitting")])
def test_with_the_oracle_blocks_draw_the_true_chain(block_size, method):
  # Within a block, first_hitting reveals one token at a time from its exact conditional; at
  # b = 1 any method does: the blocks then chain to the exact law.
  language = groundtruth.MarkovLanguage(VOCAB, seed=1)
  length = 12
  tokens, _ = decoder.sample(
    jax.random.PRNGKey(2),
    language.denoise_fn(MASK_ID),
    batch_size=3000,
    length=length,
    block_size=block_size,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method=method,
    num_steps=2,
  )
  oracles.assert_draws_the_chain(language, tokens, MASK_ID)
