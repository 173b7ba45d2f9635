"""Block diffusion (BD3-LM): the sequence cut into blocks of b tokens, each diffused given the clean
blocks before it; its bound is Σ_blocks E_t[w(t) Σ_{masked in the block} −log p(x_ℓ | x_<block,
z_t^block)] (docs/math.md, "Block diffusion").

The bound's reference path, `bounds.nelbo(block_size=b)`, calls any denoise_fn(z, time) once per
block. This module is the training path: one call of a pair denoiser

  pair_fn(z_t [B, L], x [B, L]) -> logits [B, L, V]

that returns every noisy block's logits given the clean blocks before it at once (the model's
two-stream pass, `Transformer(block_size=b)(z_t, clean=x)`). Its network is time-free: t is
drawn per block (each block's term is the MDM bound of that block, with its own t, so the sum of
unbiased terms is unbiased, and the terms' noise is independent across blocks, as in BD3-LM).

`draws` gives both paths the same t and masks, so on a block-causal network they are equal.
"""

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking

PairDenoiseFn = Callable[[jax.Array, jax.Array], jax.Array]


def draws(
  key: jax.Array,
  x: jax.Array,
  schedule,
  block_size: int,
  *,
  editable: Optional[jax.Array] = None,
  t_sampling: str = "stratified",
  row_index: Optional[jax.Array] = None,
  num_rows: Optional[int] = None,
  mask_rates: Optional[tuple] = None,
) -> dict:
  """{"t": [B, K] in (0, 1], "masked": [B, L] bool}: each block's time (stratified over the
  global batch per block) and the masked positions (an editable position of block k is masked
  with probability 1 − α(t_k)). As `bounds.nelbo`'s draws, a row's depend on its global index;
  mask_rates (β, ω): BD3-LM's clipped schedule (`bounds.nelbo`)."""
  batch, length = x.shape
  time_key, mask_key = jax.random.split(key)
  times = [
    masking.sample_times(
      jax.random.fold_in(time_key, block), batch, t_sampling, row_index=row_index, num_rows=num_rows
    )
    for block in range(length // block_size)
  ]
  t = masking.clipped_times(jnp.stack(times, axis=1), schedule, mask_rates)
  alpha = jnp.repeat(schedule.alpha(t), block_size, axis=1)
  keep = masking.uniform(masking.row_keys(mask_key, batch, row_index), x.shape) < alpha
  return {"t": t, "masked": masking.editable_or_all(x, editable) & ~keep}


def one_pass_nelbo(
  key: jax.Array,
  pair_fn: PairDenoiseFn,
  x: jax.Array,
  schedule,
  block_size: int,
  *,
  mask_id: int,
  editable: Optional[jax.Array] = None,
  t_sampling: str = "stratified",
  row_index: Optional[jax.Array] = None,
  num_rows: Optional[int] = None,
  endpoint_terms: str = "sampled",
  block_draws: Optional[dict] = None,
  mask_rates: Optional[tuple] = None,
) -> jax.Array:
  """One draw of the block bound of each sequence, in nats [B], from one pair_fn call.

  Equal in law to `bounds.nelbo(block_size=b)` with the standard estimator, and equal in value
  on the same block_draws (`draws`) for a block-causal network. A schedule with α(0) < 1 or
  α(1) > 0 needs endpoint_terms="md4" (`bounds.nelbo`'s module docstring).
  """
  if x.shape[1] % block_size:
    raise ValueError(f"block_size must divide the length {x.shape[1]}, got {block_size}.")
  if schedule.state_dependent:
    raise ValueError(f"Block diffusion takes a mask-rate schedule, got {schedule.name!r}.")
  endpoints = schedule.needs_reconstruction_term or schedule.needs_prior_term
  if endpoints and endpoint_terms != "md4":
    raise ValueError(
      f"Schedule {schedule.name!r} needs endpoint terms; block diffusion's training pass has "
      "MD4's only (endpoint_terms='md4')."
    )
  editable = masking.editable_or_all(x, editable)
  if block_draws is None:
    block_draws = draws(
      key,
      x,
      schedule,
      block_size,
      editable=editable,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
      mask_rates=mask_rates,
    )
  z_t = jnp.where(block_draws["masked"] & editable, mask_id, x).astype(x.dtype)
  ce = masking.masked_cross_entropy(pair_fn(z_t, x), x, z_t, mask_id=mask_id)
  weight = schedule.weight(block_draws["t"])  # [B, K]
  per_block = (ce.reshape(ce.shape[0], -1, block_size).sum(-1) * weight).sum(-1)
  if schedule.needs_reconstruction_term:
    return per_block + editable.sum(-1) * (1.0 - schedule.alpha_at_0) * math.log(mask_id)
  return per_block
