"""The ground-truth Markov language as 'models' with the Flax apply interface, for exact oracles."""

import jax.numpy as jnp
import numpy as np
import scipy.stats


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
    del variables, positions
    if segments is not None:  # Padding (segment 0) tells nothing: the network never reads it.
      z_t = jnp.where(segments == 0, self.vocab_size, z_t)
    return self.denoise(z_t, alpha)


def assert_draws_the_chain(language, tokens, mask_id: int):
  """Samples [n, L] follow the true chain: no mask left, mean −log p within 4 SE of the entropy,
  and the bigram counts pass a χ² test against the transition matrix (p = 1e-4)."""
  tokens = np.asarray(tokens)
  vocab, length = language.vocab_size, tokens.shape[1]
  assert not np.any(tokens == mask_id)
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  gap, se = nll.mean() - language.entropy(length), nll.std(ddof=1) / np.sqrt(nll.size)
  assert abs(gap) < 4 * se, (gap, se)
  counts = np.zeros((vocab, vocab))
  np.add.at(counts, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
  expected = counts.sum(1, keepdims=True) * language.transition
  keep = expected >= 5
  statistic = np.sum((counts - expected)[keep] ** 2 / expected[keep])
  assert statistic < scipy.stats.chi2.ppf(1 - 1e-4, keep.sum() - vocab), statistic
