"""Categorical draws with float64-accurate noise, and logit filters (temperature, top-p, top-k).

Gumbel-max with float32 noise cannot produce a Gumbel value above about 16.6
(the uniform's resolution near 1 is 2^-24), so tokens more than ~16 nats below
the best one can never be drawn: sampling silently runs at a lower
temperature (docs/math.md, "Float64-accurate Gumbel noise"). Here the exponential variate
E = −log U behind the Gumbel −log E is built from two 32-bit draws, so E is
accurate down to 2^-64 even when x64 is off, and the Gumbel reaches ~44.

A key may be one key per row [B] (`md4jax.diffusion.masking.row_keys`): then row b's noise comes
from keys[b] alone, whatever the other rows.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking

Array = jax.Array

NOISE_KINDS = ("float64", "float32")


def _accurate_exponential(key: Array, shape) -> Array:
  """Exponential(1) variates, accurate to float32 relative precision down to 2^-64."""
  high, low = jax.random.bits(key, (2,) + tuple(shape), jnp.uint32)
  two_to_minus_32 = 2.0**-32
  # v = 1 − U is uniform on (0, 1] with 64 random bits; it is stored in float32,
  # whose relative precision is what matters, since E = −log1p(−v) ≈ v for small v.
  v = (
    high.astype(jnp.float32) + (low.astype(jnp.float32) + 0.5) * two_to_minus_32
  ) * two_to_minus_32
  v = jnp.minimum(v, 1.0 - 2.0**-24)  # Rounding may reach 1.0; keep E finite.
  return -jnp.log1p(-v)


def gumbel(key: Array, shape, noise: str = "float64") -> Array:
  """Standard Gumbel noise of `shape`; with one key per row [B], row b of [B, ...] from keys[b].
  `noise="float32"` is jax.random.gumbel, kept only for comparison."""
  if masking.is_per_row(key):
    return jax.vmap(lambda row_key: gumbel(row_key, tuple(shape)[1:], noise))(key)
  if noise == "float64":
    return -jnp.log(_accurate_exponential(key, shape))
  if noise == "float32":
    return jax.random.gumbel(key, shape, jnp.float32)
  raise ValueError(f"Unknown noise {noise!r}; valid: {', '.join(NOISE_KINDS)}.")


def filter_logits(
  logits: Array,
  *,
  temperature: float = 1.0,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
) -> Array:
  """Applies temperature, then top-p (nucleus), then top-k filtering; removed entries get −inf.

  With both top_k and top_p, the order is Dream's (`sample_tokens` in its generation_utils.py:
  top_p_logits, then top_k_logits): the nucleus is taken of the whole distribution, then at most
  k of its tokens are kept. Hugging Face transformers' generate applies TopKLogitsWarper before
  TopPLogitsWarper instead (the nucleus of the renormalized top k, never more tokens than this
  order keeps); LLaDA's generate has neither. E.g. probabilities [.3, .29, .21, .2], k = 2,
  p = .5: this keeps the first two (the nucleus of .5 is {.3, .29}), transformers' order the first
  alone (.3 / .59 ≥ .5)."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}.")
  if top_k is not None and not 1 <= top_k:
    raise ValueError(f"top_k must be >= 1 or None, got {top_k}.")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}.")
  logits = logits.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  # XLA may compute the logits twice, in two fusions whose transcendental functions (a sin, an
  # exp) round differently: a threshold taken from one copy and compared with the other could
  # drop the token it came from. So which tokens are kept is decided on the sorted copy alone.
  if top_p is not None and top_p < 1.0:
    ids = jnp.broadcast_to(jnp.arange(logits.shape[-1], dtype=jnp.int32), logits.shape)
    negated, order = jax.lax.sort_key_val(-logits, ids, dimension=logits.ndim - 1)
    sorted_logits = -negated  # Descending; ties keep the lower id first.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # Smallest logit kept: the last one whose preceding mass is still below top_p; every
    # logit equal to it stays too.
    num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
    kept = _scattered(order, sorted_logits >= threshold, logits.shape)
    logits = jnp.where(kept, logits, -jnp.inf)
  if top_k is not None and top_k < logits.shape[-1]:
    top_values, top_ids = jax.lax.top_k(logits, top_k)
    kept = _scattered(top_ids, True, logits.shape)
    kept |= logits >= top_values[..., -1:]  # Ties with the k-th largest stay, as before.
    logits = jnp.where(kept, logits, -jnp.inf)
  return logits


def _scattered(ids, values, shape) -> Array:
  """[..., V] bool: values at ids [..., n] along the last axis, False elsewhere."""
  return jnp.put_along_axis(jnp.zeros(shape, bool), ids, values, axis=-1, inplace=False)


def sample_categorical(
  key: Array,
  logits: Array,
  *,
  temperature: float = 1.0,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
  noise: str = "float64",
) -> Array:
  """Draws one id per row of logits [..., V] -> [...] int32; temperature 0 is greedy. With one
  key per row [B] (logits [B, ..., V]), row b draws from keys[b] alone."""
  logits = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jnp.argmax(logits + gumbel(key, logits.shape, noise), axis=-1).astype(jnp.int32)
