"""The masked-diffusion NELBO (the forward process itself is in `md4jax.diffusion.masking`).

Pure functions over arrays and a denoiser callable (docs/math.md has the formulas):

  denoise_fn(z_t [B, L] int, alpha_t [B] float) -> logits [B, L, V]

over the clean vocabulary, V == mask_id: the mask is the first id past the
vocabulary, an input-only id that can never be predicted.

The bound. Write λ = 1 − α for the mask rate and h(λ) = (1/λ) E[Σ_masked CE]
for the expected weighted cross-entropy when every editable token is masked
independently with probability λ. The continuous-time NELBO is

  L∞ = ∫_0^1 −α′(t) h(1 − α(t)) dt  +  ∫_0^{1−α(0)} h dλ  +  ∫_{1−α(1)}^1 h dλ.

The first integral is the schedule's; the other two are the endpoint terms a
schedule with α(0) < 1 (reconstruction) or α(1) > 0 (prior) needs: the reverse
process is continued below mask rate 1 − α(0) down to 0 and above 1 − α(1) up
to the all-mask state, so the generative model always starts from all-mask and
ends fully revealed. With them the bound equals ∫_0^1 h dλ for every schedule
(the invariance theorem made exact), and each is estimated by Monte Carlo with
λ uniform on its interval. The discrete-time bound replaces the first integral
by Σ_i (α(t_{i−1}) − α(t_i)) h(1 − α(t_i)) on the grid t_i = i/T.

No truncation t ≥ ε is applied to these schedules: t is drawn in (0, 1] and a
weight only multiplies positions that are masked.

A state-dependent schedule (`schedule.state_dependent`, GenMD4) masks each
token value at its own rate; `nelbo` then evaluates `md4jax.diffusion.genmd4`'s bound
and calls denoise_fn(z_t, t) with the time t [B].

A denoiser conditioned on the time t rather than on α (time_input="t", MD4's) is
called with the t the bound drew, exactly; where a term draws the mask rate
instead (the endpoint terms, mask_count), with schedule.time_of(α).

MD4's endpoint terms (endpoint_terms="md4"): for a schedule with α(0) < 1 the
reconstruction term is the constant n (1 − α(0)) ln V (each token already
masked at t = 0 guessed uniformly: an upper bound of the sampled term, with
no gradient) and the prior term is dropped (for α(1) > 0 the result is then
not strictly a bound; MD4 calls the term negligible: α(1) = 1e-4).
"""

import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from md4jax.diffusion import genmd4, masking, uniform
from md4jax.diffusion import schedules as schedules_lib

# The forward process, re-exported: callers know them as diffusion.corrupt etc.
from md4jax.diffusion.masking import (
  T_SAMPLINGS,
  Array,
  DenoiseFn,
  checked_denoiser,
  corrupt,
  cross_entropy,
  masked_cross_entropy,
  row_keys,
  sample_times,
  subs_log_probs,
)
from md4jax.diffusion.terms import (
  TIME_INPUTS,
  continuous_loss_at,
  discrete_term,
  endpoint_term,
  mask_count_term,
  time_argument,
)

__all__ = [
  "ENDPOINT_TERMS",
  "ESTIMATORS",
  "TIME_INPUTS",
  "T_SAMPLINGS",
  "bits_per_token",
  "checked_denoiser",
  "continuous_loss_at",
  "corrupt",
  "cross_entropy",
  "masked_cross_entropy",
  "nelbo",
  "nelbo_surrogate",
  "num_valid_tokens",
  "perplexity",
  "row_keys",
  "sample_times",
  "subs_log_probs",
  "time_argument",
]

ESTIMATORS = ("standard", "forced_target", "mask_count")
ENDPOINT_TERMS = ("sampled", "md4")


def nelbo(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  schedule,
  *,
  mask_id: Optional[int] = None,
  editable: Optional[Array] = None,
  num_steps: Optional[int] = None,
  process: str = "masked",
  estimator: str = "standard",
  t_sampling: str = "stratified",
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
  reconstruction_time: float = 1e-4,
  time_input: str = "alpha",
  endpoint_terms: str = "sampled",
  draws: Optional[dict] = None,
  block_size: Optional[int] = None,
  mask_rates: Optional[tuple] = None,
) -> Array:
  """One-draw Monte Carlo estimate of the NELBO of each sequence, in nats, [B].

  Args:
    key: PRNG key. Row b draws from fold_in(key, row_index[b]) (and, stratified,
      from one u shared by the global batch), so its estimate depends on its
      global index only, never on how the batch is split.
    denoise_fn: (z_t, alpha_t) -> logits [B, L, mask_id]; (z_t, t) for a
      state-dependent schedule.
    x: clean tokens [B, L] in [0, mask_id).
    schedule: a `md4jax.diffusion.schedules` schedule (or its name).
    mask_id: the mask id, == V (masked process; the uniform process has none).
    editable: bool [B, L]; False positions (padding, prompt) are neither masked
      nor scored and do not count as tokens.
    num_steps: None for the continuous-time bound, an integer T for the
      discrete-time bound on the grid t_i = i/T (looser, → L∞ as T grows).
    process: "masked" (absorbing: a token becomes mask_id) or "uniform" (a token becomes a
      uniform draw over the V tokens, V the denoiser's logits; `md4jax.diffusion.uniform`):
      then denoise_fn(z_t, alpha_t) reads z_t in [0, V), and only the standard estimator, a
      mask-rate schedule, the sampled endpoint terms and time_input "alpha" apply; with
      block_size < L, denoise_fn(z, keep [B, L]) reads each position's probability of holding
      its clean token (`md4jax.diffusion.uniform.block_nelbo`).
    estimator: "standard" (w(t) Σ_masked CE), "forced_target" (docs/math.md § 5: one
      forced-masked target position, weight −α′(t) · n_editable), or
      "mask_count" (continuous only: uniform mask count, bounded variance).
    t_sampling: "uniform" or "stratified" (low-discrepancy over the batch).
    row_index: int [B], the rows' indices in the global batch (default 0..B−1).
    num_rows: the global batch size (default B); stratified t uses it.
    reconstruction_time: state-dependent schedules only: the ε below which
      one reconstruction step reveals everything (`md4jax.diffusion.genmd4`); 0 = none.
    time_input: mask-rate schedules: the denoiser is called with "alpha" (α(t)) or
      "t" (see the module docstring). A state-dependent schedule's always gets t.
    endpoint_terms: "sampled" (Monte Carlo draws: the exact bound) or "md4" (MD4's: a
      constant reconstruction term, no prior term; see the module docstring).
    draws: {"t": [B] float, "masked": [B, L] bool}: the times and masked positions to
      use instead of drawing them (replaying another implementation's corruptions);
      standard or mask_count estimator (whose "t" is the mask rate λ: LLaDA's Monte-Carlo
      likelihood replays as mask_count), continuous time, mask-rate schedules only. With
      block_size < L,
      "t" is [B, K], each block's time (`md4jax.diffusion.blocks.draws`).
    block_size: b, dividing L (None or L: the whole sequence is one block). Block
      diffusion's bound (BD3-LM): Σ_blocks of the bound of the block given the clean blocks
      before it, each with its own draws (of t too: independent terms, each unbiased for
      its block). The denoiser sees, for block k, the clean prefix, the noisy block and
      every later position masked (uniform process: uniform draws, and each position's keep
      probability), so the exact posterior gives the exact block law; b = 1
      is an autoregressive model's NLL. This is the reference path over any denoiser: one
      call per block (the training path: `md4jax.diffusion.blocks`).
    mask_rates: (β, ω), BD3-LM's clipped schedule (standard estimator, continuous time): t
      drawn so that the mask rate is uniform on [β, ω]. A training objective of lower variance,
      the average of the integrand over those rates: not a bound unless (β, ω) = (0, 1).
  Returns:
    Per-sequence NELBO estimates [B] (float32); their mean is unbiased.
  """
  if isinstance(schedule, str):
    schedule = schedules_lib.get_schedule(schedule)
  if process not in uniform.PROCESSES:
    raise ValueError(f"Unknown process {process!r}; valid: {', '.join(uniform.PROCESSES)}.")
  if process == "uniform":
    return uniform.checked_nelbo(
      key,
      denoise_fn,
      x,
      schedule,
      editable=editable,
      num_steps=num_steps,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
      refused=dict(
        estimator=(estimator, "standard"),
        time_input=(time_input, "alpha"),
        endpoint_terms=(endpoint_terms, "sampled"),
        draws=(draws, None),
        mask_rates=(mask_rates, None),
      ),
      block_size=block_size,
    )
  if mask_id is None:
    raise ValueError("nelbo: the masked process needs mask_id (== V, one past the vocabulary).")
  if estimator not in ESTIMATORS:
    raise ValueError(f"Unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}.")
  if num_steps is not None and (
    isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
  ):
    raise ValueError(
      f"num_steps must be None (continuous time) or an integer >= 1, got {num_steps!r}."
    )
  if estimator == "mask_count" and num_steps is not None:
    raise ValueError(
      "estimator='mask_count' estimates the continuous-time bound only; "
      "use 'standard' or 'forced_target' with num_steps."
    )
  if schedule.state_dependent and estimator != "standard":
    raise ValueError(
      f"A state-dependent schedule ({schedule.name}) has its own bound; "
      f"estimator={estimator!r} applies to mask-rate schedules only, use 'standard'."
    )
  if endpoint_terms not in ENDPOINT_TERMS:
    raise ValueError(
      f"Unknown endpoint_terms {endpoint_terms!r}; valid: {', '.join(ENDPOINT_TERMS)}."
    )
  if draws is not None and (
    estimator not in ("standard", "mask_count") or num_steps is not None or schedule.state_dependent
  ):
    raise ValueError(
      "draws replay the standard or mask_count continuous-time estimator of a mask-rate schedule; "
      f"got estimator={estimator!r}, num_steps={num_steps!r}, schedule {schedule.name!r}."
    )
  if mask_rates is not None and (
    estimator != "standard"
    or num_steps is not None
    or schedule.state_dependent
    or not 0 <= mask_rates[0] < mask_rates[1] <= 1
  ):
    raise ValueError(
      "mask_rates (β, ω) with 0 <= β < ω <= 1 clip the standard continuous-time estimator of a "
      f"mask-rate schedule; got {mask_rates!r}, estimator={estimator!r}, num_steps={num_steps!r}."
    )
  if x.ndim != 2:
    raise ValueError(f"x must be [batch, length], got shape {x.shape}.")
  chex.assert_type(x, int, custom_message="nelbo: x must be integer token ids")
  if block_size is not None and (block_size < 1 or x.shape[1] % block_size):
    raise ValueError(f"block_size must divide the length {x.shape[1]}, got {block_size}.")
  if block_size is not None and block_size < x.shape[1]:
    if schedule.state_dependent:
      raise ValueError("block_size < L takes a mask-rate schedule, not a state-dependent one.")
    return _block_nelbo(
      key,
      denoise_fn,
      x,
      schedule,
      block_size,
      mask_id=mask_id,
      editable=editable,
      num_steps=num_steps,
      estimator=estimator,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
      time_input=time_input,
      endpoint_terms=endpoint_terms,
      draws=draws,
      mask_rates=mask_rates,
    )
  if editable is not None:
    chex.assert_shape(
      editable, x.shape, custom_message="nelbo: editable must have x's shape [B, L]"
    )
  if row_index is not None:
    chex.assert_shape(row_index, x.shape[:1], custom_message="nelbo: row_index must be [B]")
  editable = masking.editable_or_all(x, editable)
  denoise_fn = checked_denoiser(denoise_fn, mask_id)
  time_key, draw_key = jax.random.split(key)
  if draws is None:
    u = sample_times(time_key, x.shape[0], t_sampling, row_index=row_index, num_rows=num_rows)
    u = masking.clipped_times(u, schedule, mask_rates)
  else:
    chex.assert_shape(draws["t"], x.shape[:1], custom_message="nelbo: draws['t'] must be [B]")
    chex.assert_shape(
      draws["masked"], x.shape, custom_message="nelbo: draws['masked'] must be [B, L]"
    )
    u = draws["t"]
  main_key, recon_key, prior_key = masking.split_keys(row_keys(draw_key, x.shape[0], row_index), 3)
  kwargs = dict(mask_id=mask_id)
  if schedule.state_dependent:
    return genmd4.nelbo(
      (main_key, recon_key),
      denoise_fn,
      x,
      schedule,
      u,
      editable,
      num_steps=num_steps,
      reconstruction_time=reconstruction_time,
      **kwargs,
    )
  time_arg = time_argument(schedule, time_input)
  if estimator == "mask_count":
    masked = None if draws is None else draws["masked"].astype(bool)
    return mask_count_term(
      main_key, denoise_fn, x, u, editable, time_arg=time_arg, masked=masked, **kwargs
    )
  kwargs["estimator"] = estimator
  if num_steps is None:
    total = continuous_loss_at(
      main_key,
      denoise_fn,
      x,
      schedule,
      u,
      editable=editable,
      time_input=time_input,
      masked=None if draws is None else draws["masked"].astype(bool),
      **kwargs,
    )
  else:
    total = discrete_term(
      main_key,
      denoise_fn,
      x,
      schedule,
      u,
      editable,
      num_steps=num_steps,
      time_arg=time_arg,
      **kwargs,
    )
  if endpoint_terms == "md4":  # A constant: each token masked at t = 0 guessed uniformly.
    if schedule.needs_reconstruction_term:
      total += editable.sum(-1) * (1.0 - schedule.alpha_at_0) * math.log(mask_id)
    return total
  if schedule.needs_reconstruction_term:
    total += endpoint_term(
      recon_key,
      denoise_fn,
      x,
      editable,
      0.0,
      1.0 - schedule.alpha_at_0,
      time_arg=time_arg,
      **kwargs,
    )
  if schedule.needs_prior_term:
    total += endpoint_term(
      prior_key,
      denoise_fn,
      x,
      editable,
      1.0 - schedule.alpha_at_1,
      1.0,
      time_arg=time_arg,
      **kwargs,
    )
  return total


def _block_nelbo(key, denoise_fn, x, schedule, block_size, *, mask_id, editable, draws, **kwargs):
  """Σ_k NELBO(block k | blocks < k): block k alone editable, every later block masked. A loop
  over blocks (not unrolled: one network in the program, one block's activations live)."""
  editable = masking.editable_or_all(x, editable)
  num_blocks = x.shape[1] // block_size
  if draws is not None:
    chex.assert_shape(
      draws["t"], (x.shape[0], num_blocks), custom_message="nelbo: block draws['t'] is [B, K]"
    )
  block_of = jnp.arange(x.shape[1]) // block_size

  def add_block(block, total):
    future, in_block = block_of > block, block_of == block
    block_draws = None
    if draws is not None:
      block_draws = {"t": draws["t"][:, block], "masked": draws["masked"].astype(bool) & in_block}
    return total + nelbo(
      jax.random.fold_in(key, block),
      lambda z, time: denoise_fn(jnp.where(future, mask_id, z), time),
      x,
      schedule,
      mask_id=mask_id,
      editable=editable & in_block,
      draws=block_draws,
      **kwargs,
    )

  return jax.lax.fori_loop(0, num_blocks, add_block, jnp.zeros(x.shape[:1], jnp.float32))


def nelbo_surrogate(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  schedule,
  *,
  mask_id: int,
  editable: Optional[Array] = None,
  gradient: str = "rloo",
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
  reconstruction_time: float = 1e-4,
) -> tuple[Array, Array]:
  """(NELBO [B], surrogate [B]) of a state-dependent schedule from two draws per row, t stratified.

  Equal in value; the surrogate's gradient also holds the score-function term
  of the schedule's parameters ("rloo" or "score", `md4jax.diffusion.genmd4.surrogate`).
  """
  if not schedule.state_dependent:
    raise ValueError(f"nelbo_surrogate is for state-dependent schedules, got {schedule.name!r}.")
  editable = masking.editable_or_all(x, editable)
  time_key, draw_key = jax.random.split(key)
  u = sample_times(time_key, x.shape[0], "stratified", row_index=row_index, num_rows=num_rows)
  return genmd4.surrogate(
    row_keys(draw_key, x.shape[0], row_index),
    checked_denoiser(denoise_fn, mask_id),
    x,
    schedule,
    u,
    editable,
    mask_id=mask_id,
    gradient=gradient,
    reconstruction_time=reconstruction_time,
  )


def num_valid_tokens(x: Array, editable: Optional[Array] = None) -> Array:
  """Number of tokens each sequence is scored on, [B] (the per-token denominator)."""
  return masking.editable_or_all(x, editable).sum(-1)


def bits_per_token(total_nats, num_tokens):
  """NELBO in bits per valid token: divides by the valid-token count, never the mask count."""
  return total_nats / (num_tokens * math.log(2.0))


def perplexity(total_nats, num_tokens):
  """exp(NELBO per valid token): an upper bound on the true perplexity."""
  return jnp.exp(total_nats / num_tokens)
