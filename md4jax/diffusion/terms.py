"""The Monte Carlo terms of the NELBO (`md4jax.diffusion.bounds` sums them; the formulas are in
its module docstring and docs/math.md): the continuous-time integrand, a discrete-time step, the
endpoint terms and the mask-count estimator, each one draw per sequence [B].
"""

from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking
from md4jax.diffusion.masking import Array, DenoiseFn, corrupt, masked_cross_entropy

TIME_INPUTS = ("alpha", "t")  # What a mask-rate schedule's denoiser is called with.


def _alpha_itself(alpha, t=None):
  del t
  return alpha


def time_argument(schedule, time_input: str):
  """(alpha, t or None) -> the denoiser's time argument: alpha, or t (schedule.time_of(alpha)
  where no t was drawn)."""
  if time_input not in TIME_INPUTS:
    raise ValueError(f"Unknown time_input {time_input!r}; valid: {', '.join(TIME_INPUTS)}.")
  if time_input == "alpha":
    return _alpha_itself
  return lambda alpha, t=None: schedule.time_of(alpha) if t is None else t


def _weighted_term(
  key,
  denoise_fn,
  x,
  alpha_t,
  editable,
  *,
  time,
  mask_id,
  estimator,
  per_mask_weight,
  rate_weight,
  masked=None,
) -> Array:
  """One Monte Carlo draw of a term rate_weight · h(1 − alpha_t), per sequence [B].

  The denoiser is called with `time` (alpha_t, or the t of it). "standard" scores every
  masked position with per_mask_weight = rate_weight / λ (masked [B, L]: given masked
  positions instead of a draw); "forced_target" forces one uniformly chosen editable
  position I masked and scores only it: E[CE_I | I masked] · n_editable = h(λ), so the
  weight is rate_weight · n_editable (docs/math.md § 5, with −α′(t)/g(t) as rate_weight).
  """
  n_editable = editable.sum(-1)
  if estimator == "standard":
    if masked is None:
      z_t = corrupt(key, x, alpha_t, mask_id=mask_id, editable=editable)
    else:
      z_t = jnp.where(masked & editable, mask_id, x).astype(x.dtype)
    ce = masked_cross_entropy(denoise_fn(z_t, time), x, z_t, mask_id=mask_id)
    return per_mask_weight * ce.sum(-1)
  target_key, mask_key = masking.split_keys(key, 2)
  scores = jnp.where(editable, masking.uniform(target_key, x.shape), -1.0)
  target = jnp.argmax(scores, axis=-1)  # Uniform among editable positions.
  forced = jax.nn.one_hot(target, x.shape[-1], dtype=jnp.bool_) & editable
  z_t = corrupt(mask_key, x, alpha_t, mask_id=mask_id, editable=editable & ~forced)
  z_t = jnp.where(forced, mask_id, z_t).astype(x.dtype)
  ce = masked_cross_entropy(denoise_fn(z_t, time), x, z_t, mask_id=mask_id)
  target_ce = jnp.take_along_axis(ce, target[:, None], axis=-1)[:, 0]
  return jnp.where(n_editable > 0, rate_weight * n_editable * target_ce, 0.0)


def continuous_loss_at(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  schedule,
  t: Array,
  *,
  mask_id: int,
  editable: Optional[Array] = None,
  estimator: str = "standard",
  time_input: str = "alpha",
  masked: Optional[Array] = None,
) -> Array:
  """The continuous-time integrand at given times t [B]: w(t) Σ_masked CE, per sequence [B].

  Its mean over t ~ U(0, 1] is the schedule's part of L∞ (no endpoint terms). The
  denoiser is called with α(t), or with t itself for time_input="t"; masked [B, L]
  (standard estimator) gives the masked positions instead of drawing them.
  """
  editable = masking.editable_or_all(x, editable)
  alpha = schedule.alpha(t)
  return _weighted_term(
    key,
    denoise_fn,
    x,
    alpha,
    editable,
    mask_id=mask_id,
    time=time_argument(schedule, time_input)(alpha, t),
    estimator=estimator,
    per_mask_weight=schedule.weight(t),
    rate_weight=-schedule.dalpha(t),
    masked=masked,
  )


def discrete_term(
  key,
  denoise_fn,
  x,
  schedule,
  u,
  editable,
  *,
  num_steps,
  mask_id,
  estimator,
  time_arg=_alpha_itself,
):
  """One draw of the discrete-time sum: step i uniform on 1..T (from u in (0, 1]), times T."""
  step = jnp.clip(jnp.ceil(u * num_steps), 1, num_steps)
  t, s = step / num_steps, (step - 1) / num_steps
  mask_rate_t = schedule.mask_prob(t)
  rate_weight = num_steps * (mask_rate_t - schedule.mask_prob(s))  # T (α(s) − α(t))
  alpha = schedule.alpha(t)
  return _weighted_term(
    key,
    denoise_fn,
    x,
    alpha,
    editable,
    mask_id=mask_id,
    time=time_arg(alpha, t),
    estimator=estimator,
    per_mask_weight=rate_weight / mask_rate_t,
    rate_weight=rate_weight,
  )


def endpoint_term(
  key, denoise_fn, x, editable, low, high, *, mask_id, estimator, time_arg=_alpha_itself
):
  """One draw of ∫_low^high h(λ) dλ with λ uniform on (low, high]."""
  time_key, term_key = masking.split_keys(key, 2)
  mask_rate = high - (high - low) * masking.uniform(time_key, (x.shape[0],))
  return _weighted_term(
    term_key,
    denoise_fn,
    x,
    1.0 - mask_rate,
    editable,
    mask_id=mask_id,
    time=time_arg(1.0 - mask_rate),
    estimator=estimator,
    per_mask_weight=(high - low) / mask_rate,
    rate_weight=jnp.full_like(mask_rate, high - low),
  )


def mask_count_term(
  key, denoise_fn, x, u, editable, *, mask_id, time_arg=_alpha_itself, masked=None
):
  """∫_0^1 h dλ with λ integrated out given the mask count k (bounded variance).

  Under λ ~ U(0, 1) the number k of masked editable positions is uniform on
  0..n, the masked set is a uniform k-subset, and, reweighted by 1/λ, λ | k is
  Beta(k, n − k + 1): the k-th smallest of the n uniforms that choose the set.
  Hence ∫ h dλ = E_{k ~ U{1..n}} [(n/k) Σ_{masked} CE(z, α = 1 − λ)], exact for
  any denoiser of (z, α), and with no 1/λ weight left.

  masked [B, L] bool replays a draw: its masked set (k its size) at mask rate λ = u, as LLaDA's
  Monte-Carlo likelihood draws them (k uniform, λ = k / n: exact for a time-free denoiser).
  """
  n_editable = editable.sum(-1)
  if masked is not None:
    masked = masked & editable
    num_masked, alpha = jnp.maximum(masked.sum(-1), 1), 1.0 - u
  else:
    num_masked = jnp.clip(jnp.ceil(u * n_editable), 1, None).astype(jnp.int32)
    scores = jnp.where(editable, masking.uniform(key, x.shape), 2.0)  # Non-editable sort last.
    order = jnp.argsort(scores, axis=-1)
    # Ranks, not a threshold: float32 uniforms tie often enough at long L to mask k + 1.
    masked = editable & (jnp.argsort(order, axis=-1) < num_masked[:, None])
    sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
    kth_smallest = jnp.take_along_axis(sorted_scores, num_masked[:, None] - 1, axis=-1)
    alpha = 1.0 - jnp.minimum(kth_smallest[:, 0], 1.0)  # Sequences with nothing editable: α = 0.
  z = jnp.where(masked, mask_id, x).astype(x.dtype)
  ce = masked_cross_entropy(denoise_fn(z, time_arg(alpha)), x, z, mask_id=mask_id)
  return jnp.where(n_editable > 0, n_editable / num_masked * ce.sum(-1), 0.0)
