"""The ground-truth Markov language as 'models' with the Flax apply interface, for exact oracles."""

import jax.numpy as jnp


class OracleChain:
  """The true chain as a causal model: logits = log p(x_i | x_{i-1}), and log π after BOS."""

  def __init__(self, language):
    self.log_initial = jnp.log(jnp.asarray(language.initial, jnp.float32))
    self.log_transition = jnp.log(jnp.asarray(language.transition, jnp.float32))
    self.vocab_size = language.vocab_size

  def apply(self, variables, inputs, alpha=None, segments=None, positions=None):
    del variables, alpha, segments, positions
    previous = self.log_transition[jnp.minimum(inputs, self.vocab_size - 1)]
    return jnp.where((inputs == self.vocab_size)[..., None], self.log_initial, previous)


class OracleDenoiser:
  """The exact SUBS denoiser p(x_ℓ | visible tokens) as a masked diffusion model."""

  block_size = 0  # Not block diffusion: objective.sequence_nats reads the model's block size.

  def __init__(self, language):
    self.denoise = language.denoise_fn(mask_id=language.vocab_size)
    self.vocab_size = language.vocab_size

  def apply(self, variables, z_t, alpha=None, segments=None, positions=None):
    del variables, segments, positions
    return self.denoise(z_t, alpha)
