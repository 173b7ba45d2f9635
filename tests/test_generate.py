"""CLI sampling: AR decoding is causal, in the vocabulary, and greedy is the argmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_an_ar_model_takes_only_the_draws_settings():
  """An ar model decodes token by token whatever sample.method names: a threshold or ReMDM
  setting of the mdm samplers is not its own, and guidance is refused at validation."""
  config = config_lib.load_config("tiny_ar")
  config.sample.method, config.sample.temperature = "threshold", 0.0
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  params = state_lib.init_state(config, model, optimizer, mesh).params
  source = sources.make_source(config)
  tokens, nfe, _, _ = generate.generate(config, model, params, source, jax.random.PRNGKey(0))
  assert nfe == config.data.seq_len and generate.settings(config)["threshold"] is None
  logits = model.apply({"params": params}, objective.ar_inputs(tokens, config.data.vocab_size))
  np.testing.assert_array_equal(jnp.argmax(logits, -1), tokens)  # Greedy, token by token.
  config.sample.guidance_scale, config.sample.prompt = 1.0, "1"
  with pytest.raises(ValueError, match="sample.guidance_scale contrasts a masked diffusion"):
    config_lib.validate_config(config, num_devices=1)
