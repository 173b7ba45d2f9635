"""CLI sampling: AR decoding is causal, in the vocabulary, and greedy is the argmax."""

import jax
import jax.numpy as jnp
import numpy as np

from md4jax import config as config_lib
from md4jax.app import generate
from md4jax.data import sources
from md4jax.runtime import sharding
from md4jax.training import objective
from md4jax.training import state as state_lib


def test_ar_sample_is_causal_and_in_vocab():
  config = config_lib.load_config("tiny_ar")
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  source = sources.make_source(config)
  tokens, nfe, _, _ = generate.generate(config, model, state.params, source, jax.random.PRNGKey(0))
  assert nfe == config.data.seq_len
  assert tokens.shape == (config.sample.num_samples, config.data.seq_len)
  assert tokens.min() >= 0 and tokens.max() < config.data.vocab_size
  greedy = config.copy_and_resolve_references()
  greedy.sample.temperature = 0.0
  sequence = generate.generate(greedy, model, state.params, source, jax.random.PRNGKey(1))[0][0]
  # Greedy decoding: each token is the argmax of the model given the tokens before it.
  logits = model.apply(
    {"params": state.params}, objective.ar_inputs(sequence[None], config.data.vocab_size)
  )[0]
  np.testing.assert_array_equal(jnp.argmax(logits, -1), sequence)
