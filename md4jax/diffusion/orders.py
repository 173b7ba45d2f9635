"""Exact likelihoods of the any-order autoregressive models a denoiser defines, and their
importance-weighted mixture: likelihoods tighter than the NELBO (docs/math.md, § 5b).

Pure functions over arrays and a denoiser callable, as in `md4jax.diffusion.bounds`:

  denoise_fn(z [B, L] int, alpha [B] float) -> logits [B, L, V], V == mask_id.

For an order π of the editable positions,

  log p_π(x) = Σ_i log μ(x_{π_i} | x_{π_<i} shown, the other editable positions masked),

one network call per editable position. The denoiser's second argument is the share of
editable positions shown, (i − 1)/n when π_i is scored: the α at which that many of n tokens are
expected visible, so a time-conditioned network gets an input it was trained near (a time-free
one ignores it).
Positions that are not editable (padding, a prompt) are always shown and never scored.

The continuous-time NELBO of a time-free denoiser is E_π[−log p_π(x)] over uniform orders, and
−log((1/K) Σ_k p_{π_k}(x)) over K random orders is, in expectation, at most the NELBO and
non-increasing in K, towards the model's own −log p(x).
"""

import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from md4jax.diffusion import masking
from md4jax.diffusion.masking import Array, DenoiseFn

__all__ = ["iw_orders_nll", "order_nll", "random_orders", "random_orders_nlls"]


def order_nll(
  denoise_fn: DenoiseFn,
  x: Array,
  order: Array,
  *,
  mask_id: int,
  editable: Optional[Array] = None,
) -> Array:
  """−log p_π(x) of each sequence in nats [B]: the chain rule along `order`.

  Args:
    denoise_fn: (z [B, L], alpha [B]) -> logits [B, L, mask_id].
    x: clean tokens [B, L].
    order: a permutation of 0..L−1, [L] (every row) or [B, L] (one per row); left to right is
      arange(L). Positions that are not editable are skipped wherever they stand in it.
    mask_id: the mask id, == V.
    editable: bool [B, L]; False positions (padding, prompt) are always visible, never scored.
  Returns:
    Nats [B] (float32); exactly −log p(x) for the exact posterior, whatever the order.
  """
  if x.ndim != 2:
    raise ValueError(f"x must be [batch, length], got shape {x.shape}.")
  chex.assert_type(x, int, custom_message="order_nll: x must be integer token ids")
  order = jnp.broadcast_to(jnp.asarray(order, jnp.int32), x.shape)
  editable = masking.editable_or_all(x, editable)
  chex.assert_shape(editable, x.shape, custom_message="order_nll: editable must be [B, L]")
  denoise_fn = masking.checked_denoiser(denoise_fn, mask_id)
  # Editable positions first, each keeping its place in the order: step i < n scores the i-th.
  fixed_last = ~jnp.take_along_axis(editable, order, axis=-1)
  order = jnp.take_along_axis(order, jnp.argsort(fixed_last, axis=-1, stable=True), axis=-1)
  rank = jnp.argsort(order, axis=-1)  # rank[b, ℓ]: the step that reveals position ℓ.
  n_editable = editable.sum(-1)

  def step(i, total):
    z = jnp.where(editable & (rank >= i), mask_id, x).astype(x.dtype)
    alpha = i / jnp.maximum(n_editable, 1).astype(jnp.float32)
    logits = denoise_fn(z, alpha)
    position = order[:, i]
    chosen = jnp.take_along_axis(logits, position[:, None, None], axis=1)[:, 0]  # [B, V]
    target = jnp.take_along_axis(x, position[:, None], axis=1)[:, 0]
    return total + jnp.where(i < n_editable, masking.cross_entropy(chosen, target), 0.0)

  # A loop, not unrolled: one network in the program. It stops at the most editable tokens of
  # any row, so prompts and padding cost no calls.
  return jax.lax.fori_loop(0, jnp.max(n_editable), step, jnp.zeros(x.shape[:1], jnp.float32))


def random_orders(key: Array, batch: int, length: int, row_index: Optional[Array] = None) -> Array:
  """[batch, length] int32: a uniform random permutation per row, row b from
  fold_in(key, row_index[b]) (default b), so a row's order does not depend on its batch."""
  keys = masking.row_keys(key, batch, row_index)
  return jax.vmap(lambda k: jax.random.permutation(k, length))(keys).astype(jnp.int32)


def random_orders_nlls(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  num_orders: int,
  *,
  mask_id: int,
  editable: Optional[Array] = None,
  row_index: Optional[Array] = None,
) -> Array:
  """−log p_{π_k}(x) [K, B] over K = num_orders random orders per row, one order at a time.

  Order k of row b comes from random_orders(fold_in(key, k), row_index=row_index), so it
  depends on k and row_index[b] (default b) only.
  """
  if isinstance(num_orders, bool) or not isinstance(num_orders, int) or num_orders < 1:
    raise ValueError(f"num_orders must be an integer >= 1, got {num_orders!r}.")

  def nll_of(k):
    orders = random_orders(jax.random.fold_in(key, k), *x.shape, row_index)
    return order_nll(denoise_fn, x, orders, mask_id=mask_id, editable=editable)

  return jax.lax.map(nll_of, jnp.arange(num_orders))


def iw_orders_nll(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  num_orders: int,
  *,
  mask_id: int,
  editable: Optional[Array] = None,
  row_index: Optional[Array] = None,
) -> Array:
  """−log((1/K) Σ_k p_{π_k}(x)) over K = num_orders random orders per row, in nats [B].

  An upper bound on the model's −log p(x) in expectation, at most the NELBO's (a time-free
  denoiser) and non-increasing in K; K = 1 has the NELBO's mean. The orders are
  `random_orders_nlls`'s.
  """
  nlls = random_orders_nlls(
    key, denoise_fn, x, num_orders, mask_id=mask_id, editable=editable, row_index=row_index
  )
  return math.log(num_orders) - jax.nn.logsumexp(-nlls, axis=0)
