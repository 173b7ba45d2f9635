"""Estimates of a sequence's log-likelihood log π(x_editable | the rest) under a masked denoiser.

A masked diffusion LM has no exact log π(x); post-training (policy ratios, KL to a reference,
preference margins) uses one of these estimates instead (docs/math.md § 12):

  "nelbo"    −(the NELBO), the mean of `draws` mask-count draws: a lower bound on log π in
             expectation, equal to it for the exact denoiser; variance falls as 1/draws.
  "d1"       d1's one-step estimate: every editable position masked, each prompt position masked
             with probability `prompt_mask_prob`, Σ_editable log π(x_ℓ | z): one call, biased
             (a product of marginals, not the joint).
  "coupled"  DiffuCoder's coupled masks: t ~ U(0, 1), a set M masked at rate t and its complement
             at rate 1 − t, each weighted as the standard NELBO term (1/t, 1/(1 − t)); every
             editable token is scored exactly once over the pair. Unbiased for the NELBO, two
             calls per draw (`draws` pairs).

Each draw depends on (key, the row's index) only, so a policy and its reference called with
the same key see the same times and masks (VRPO's shared draws), and a row's estimate does not
depend on its batch.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import bounds, masking, schedules

ESTIMATORS = ("nelbo", "d1", "coupled")


def log_likelihood(
  key: jax.Array,
  denoise_fn,
  x: jax.Array,
  *,
  mask_id: int,
  editable: jax.Array,
  estimator: str = "nelbo",
  draws: int = 1,
  prompt_mask_prob: float = 0.15,
  row_index: Optional[jax.Array] = None,
) -> jax.Array:
  """The estimate [B] (nats) of log π(x at editable | x elsewhere) for each row.

  denoise_fn(z [B, L], alpha [B]) -> logits [B, L, V], V = mask_id. editable [B, L] bool: the
  positions scored (a completion); the others are its context (a prompt) or padding, never scored.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"Unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}.")
  if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
    raise ValueError(f"draws must be an integer >= 1, got {draws!r}.")
  if not 0.0 <= prompt_mask_prob < 1.0:
    raise ValueError(f"prompt_mask_prob must be in [0, 1), got {prompt_mask_prob}.")
  editable = editable.astype(bool)
  if estimator == "d1":
    return _one_step(key, denoise_fn, x, editable, mask_id, prompt_mask_prob, row_index)
  total = 0.0
  for draw in range(draws):
    draw_key = jax.random.fold_in(key, draw)
    if estimator == "nelbo":
      total -= bounds.nelbo(
        draw_key,
        denoise_fn,
        x,
        "linear",
        mask_id=mask_id,
        editable=editable,
        estimator="mask_count",
        t_sampling="uniform",
        row_index=row_index,
      )
    else:
      total -= _coupled_pair(draw_key, denoise_fn, x, editable, mask_id, row_index)
  return total / draws


def _coupled_pair(key, denoise_fn, x, editable, mask_id, row_index):
  """The NELBO at (t, M) and at (1 − t, M's complement), averaged: [B]."""
  time_key, mask_key = masking.split_keys(masking.row_keys(key, x.shape[0], row_index), 2)
  # t on the midpoints (2k + 1)/2^24 of a 2^23-point grid: exact in float32, never 0 or 1 (whose
  # weight 1/t or 1/(1 − t) would meet an empty set as inf · 0), and 1 − t on the same grid.
  grid = jax.vmap(lambda k: jax.random.randint(k, (), 0, 2**23))(time_key)
  t = (2 * grid + 1).astype(jnp.float32) / 2.0**24
  masked = editable & (masking.uniform(mask_key, x.shape) < t[:, None])

  def term(times, chosen):
    return bounds.nelbo(
      key,  # Unused: the draws are given.
      denoise_fn,
      x,
      schedules.get_schedule("linear"),
      mask_id=mask_id,
      editable=editable,
      draws={"t": times, "masked": chosen},
      row_index=row_index,
    )

  return 0.5 * (term(t, masked) + term(1.0 - t, editable & ~masked))


def _one_step(key, denoise_fn, x, editable, mask_id, prompt_mask_prob, row_index):
  u = masking.uniform(masking.row_keys(key, x.shape[0], row_index), x.shape)
  z = jnp.where(editable | (u < prompt_mask_prob), mask_id, x).astype(x.dtype)
  logits = masking.checked_denoiser(denoise_fn, mask_id)(z, jnp.zeros(x.shape[:1]))
  return -jnp.where(editable, masking.cross_entropy(logits, x), 0.0).sum(-1)
