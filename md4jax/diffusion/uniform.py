"""Uniform-state diffusion (UDLM, DUO): the forward process, its NELBO and its reverse step.

Per editable position, z_t keeps the clean token with probability α(t) and is otherwise a
uniform draw over the V tokens (which may be the clean token itself):

  q_t(z = a | x = y) = α [a = y] + c,   c = (1 − α) / V.

There is no mask id: the denoiser reads z_t [B, L] in [0, V) and returns logits [B, L, V],
μ_θ(y | z_t), its estimate of the clean token at every position (docs/math.md § 13 derives
what follows). Pure functions over arrays and a denoise_fn(z_t, alpha_t [B]); block diffusion's
(`block_nelbo`) reads each position's own α, [B, L].

The continuous-time bound. As a continuous-time chain every token jumps to each other token at
rate β/V, β = −α′/α. Given x, the reverse rate at position i from z_i = a to v ≠ a is
(β/V) ρ_x(v), and the model's is (β/V) ρ_θ(v) with

  ρ_μ(v) = (α/c) μ_v + (1 − μ_a) + μ_a c/(α + c)     (μ = one_hot(x) gives ρ_x),

so the integrand is (β/V) Σ_i Σ_{v≠a} [ρ_θ − ρ_x − ρ_x log(ρ_θ/ρ_x)] ≥ 0 (Campbell et al. 2022;
UDLM's and DUO's closed form). With the exact posterior μ = p(x_i | z_t) it is unbiased for
−log p(x). A schedule with α(1) > 0 adds the prior term KL(q_1(· | x_i) ‖ uniform), a constant;
one with α(0) < 1 the reconstruction term −log μ_θ(x_i | z_0), z_0 drawn at α(0).

The discrete-time bound on the grid t_i = i/T: T · E_i Σ_positions KL(q(z_s | z_t, x) ‖
p_θ(z_s | z_t)), s = t_{i−1}, with p_θ(z_s = v | z_t) = Σ_y μ_θ(y) q(z_s = v | z_t, x = y) —
the ancestral sampler's step (`reverse_probs`). Above the continuous bound, → it as T grows.
"""

import math
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp

from md4jax.diffusion import masking
from md4jax.diffusion.masking import Array, DenoiseFn, row_keys, sample_times

PROCESSES = ("masked", "uniform")


def uniform_tokens(key: Array, shape: tuple, vocab_size: int) -> Array:
  """Tokens uniform on [0, vocab_size) of `shape` [B, ...] (per-row keys: row b from keys[b])."""
  if masking.is_per_row(key):
    return jax.vmap(lambda k: jax.random.randint(k, shape[1:], 0, vocab_size))(key)
  return jax.random.randint(key, shape, 0, vocab_size)


def corrupt(
  key: Array, x: Array, alpha_t, *, vocab_size: int, editable: Optional[Array] = None
) -> Array:
  """q(z_t | x): each editable token kept with probability alpha_t (scalar, [B] or [B, L]), else a
  uniform draw over the vocab_size tokens; non-editable positions (padding, prompt) kept."""
  chex.assert_rank(x, 2, custom_message="corrupt: x must be clean tokens [B, L]")
  alpha = jnp.asarray(alpha_t)
  alpha = alpha[:, None] if alpha.ndim == 1 else alpha
  keep_key, token_key = masking.split_keys(key, 2)
  keep = masking.uniform(keep_key, x.shape) < alpha
  if editable is not None:
    keep = keep | ~editable
  return jnp.where(keep, x, uniform_tokens(token_key, x.shape, vocab_size)).astype(x.dtype)


def _log_rate_ratios(log_probs: Array, z_t: Array, log_odds: Array, log_stay: Array) -> Array:
  """log ρ_θ(v) [B, L, V] (module docstring) from the denoiser's log μ [B, L, V] at z_t [B, L]:
  a log-sum of its three terms, so no term is lost to cancellation (1 − μ_a is the sum of the
  other tokens' probabilities). The entry at v = z_t is not a jump and is unused."""
  at_current = jax.nn.one_hot(z_t, log_probs.shape[-1], dtype=jnp.bool_)
  log_at = jnp.take_along_axis(log_probs, z_t[..., None], axis=-1)  # log μ_a
  log_rest = jax.nn.logsumexp(jnp.where(at_current, -jnp.inf, log_probs), -1, keepdims=True)
  return jnp.logaddexp(log_odds + log_probs, jnp.logaddexp(log_rest, log_at + log_stay))


def _per_token(value: Array) -> Array:
  """A per-sequence [B] or per-position [B, L] value as [B, 1 or L, 1], against [B, L, V]."""
  return value[:, None, None] if value.ndim == 1 else value[..., None]


def continuous_integrand(
  log_probs: Array, x: Array, z_t: Array, alpha: Array, mask_prob: Array, rate: Array
) -> Array:
  """Σ_{v≠z_i} of the bound's integrand at each position, [B, L] (α, 1 − α and β = rate: [B],
  or [B, L] per position): in log ratios, ρ_x (e^u − 1 − u) with u = log ρ_θ − log ρ_x,
  accurate both where the terms are tiny (a confident, correct denoiser) and where ρ_x ~ 1/t is
  huge (a token noised at small t)."""
  vocab_size = log_probs.shape[-1]
  # t^K of a polynomial schedule underflows float32 at the smallest t = u²: keep log finite.
  mask_prob = jnp.maximum(mask_prob, jnp.finfo(jnp.float32).tiny)
  log_odds = _per_token(math.log(vocab_size) + jnp.log(alpha) - jnp.log(mask_prob))  # α/c
  log_stay = _per_token(jnp.log(mask_prob) - jnp.log(vocab_size * alpha + mask_prob))
  tokens = jnp.arange(vocab_size)
  noised = (z_t != x)[..., None]
  # log ρ_x: log c/(α + c) off a clean position; from a noised one, log (α + c)/c into x, else 0.
  log_true = jnp.where(
    noised, jnp.where(tokens == x[..., None], jnp.logaddexp(log_odds, 0.0), 0.0), log_stay
  )
  jump = tokens != z_t[..., None]
  # The v = z_t entry is no jump: set to 0 before any exp, so nothing of it reaches a gradient.
  log_model = jnp.where(jump, _log_rate_ratios(log_probs, z_t, log_odds, log_stay), 0.0)
  log_true = jnp.where(jump, log_true, 0.0)
  gap = log_model - log_true
  # (β/V) ρ_x (e^u − 1 − u), with β/V inside the exponentials (ρ alone passes float32's range
  # at small t): for small u by expm1 (no cancellation), for large u as ρ_θ − ρ_x (1 + u), so
  # e^u itself, up to (V/t)², is never formed.
  log_scale = _per_token(jnp.log(rate / vocab_size))
  weight = jnp.exp(log_true + log_scale)
  bounded = jnp.minimum(gap, 1.0)
  small = weight * (jnp.expm1(bounded) - bounded)
  large = jnp.exp(log_model + log_scale) - weight * (1.0 + gap)
  return jnp.where(jump, jnp.where(gap > 1.0, large, small), 0.0).sum(-1)


def reverse_probs(
  probs: Array, z_t: Array, alpha_t: Array, alpha_s: Array, *, eps: float = 0.0
) -> Array:
  """p(z_s = v | z_t) [B, L, V] = Σ_y μ(y) q(z_s = v | z_t, x = y), s < t, for the clean-token
  law probs [B, L, V] (one-hot: the true posterior q(z_s | z_t, x)); alpha_t, alpha_s [B].

  q(z_s = v | z_t = a, y) = q(a | v; α_t/α_s) q_s(v | y) / q_t(a | y). At α_s = 1 it is μ."""
  vocab_size = probs.shape[-1]
  alpha_t, alpha_s = alpha_t[:, None, None], alpha_s[:, None, None]
  spread_t, spread_s = (1.0 - alpha_t) / vocab_size, (1.0 - alpha_s) / vocab_size
  step = alpha_t / alpha_s
  current = jax.nn.one_hot(z_t, vocab_size, dtype=probs.dtype)
  # f_y = μ_y / q_t(a | y); then Σ_y μ_y q_s(v | y) / q_t(a | y) = α_s f_v + c_s Σ_y f_y.
  scaled = probs / (alpha_t * current + spread_t)
  into = alpha_s * scaled + spread_s * scaled.sum(-1, keepdims=True)
  weights = (step * current + (1.0 - step) / vocab_size) * into + eps
  return weights / weights.sum(-1, keepdims=True)


def _kl_rows(target: Array, model: Array) -> Array:
  """Σ_v target log(target / model) over the last axis, with 0 log 0 = 0."""
  safe = jnp.where(target > 0, target, 1.0)
  return jnp.where(target > 0, target * (jnp.log(safe) - jnp.log(model)), 0.0).sum(-1)


def prior_kl(alpha_1: float, vocab_size: int) -> float:
  """KL(q_1(· | x_i) ‖ uniform) per editable token: the prior term of α(1) > 0, in nats."""
  spread = (1.0 - alpha_1) / vocab_size
  kept = alpha_1 + spread
  rest = (vocab_size - 1) * spread * math.log(spread * vocab_size) if spread > 0 else 0.0
  return kept * math.log(kept * vocab_size) + rest


def _log_probs(denoise_fn, z_t, alpha):
  return jax.nn.log_softmax(denoise_fn(z_t, alpha).astype(jnp.float32), axis=-1)


def _jump_rate(schedule, t: Array, alpha: Array) -> Array:
  """β = −α′/α at t; where α = 0 (t = 1 of a schedule ending all-noise) the integrand's limit
  is 0."""
  return jnp.where(alpha > 0, -schedule.dalpha(t) / jnp.where(alpha > 0, alpha, 1.0), 0.0)


def continuous_loss_at(
  key: Array, denoise_fn: DenoiseFn, x: Array, schedule, t: Array, *, editable: Array
) -> Array:
  """The continuous-time integrand at times t [B], one draw of z_t, summed per sequence [B]:
  its t-integral over (0, 1] is the bound without endpoint terms."""
  vocab_size = jax.eval_shape(denoise_fn, x, t).shape[-1]
  alpha, mask_prob = schedule.alpha(t), schedule.mask_prob(t)
  z_t = corrupt(key, x, alpha, vocab_size=vocab_size, editable=editable)
  rate = _jump_rate(schedule, t, alpha)
  log_probs = _log_probs(denoise_fn, z_t, alpha)
  integrand = continuous_integrand(log_probs, x, z_t, alpha, mask_prob, rate)
  return jnp.where(editable, integrand, 0.0).sum(-1)


def nelbo(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  schedule,
  *,
  vocab_size: int,
  editable: Optional[Array] = None,
  num_steps: Optional[int] = None,
  t_sampling: str = "stratified",
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
) -> Array:
  """One-draw estimate of the uniform-state NELBO of each sequence, nats [B] (`bounds.nelbo`
  with process="uniform" checks the arguments and calls this)."""
  editable = masking.editable_or_all(x, editable)
  time_key, draw_key = jax.random.split(key)
  u = sample_times(time_key, x.shape[0], t_sampling, row_index=row_index, num_rows=num_rows)
  main_key, recon_key = masking.split_keys(row_keys(draw_key, x.shape[0], row_index), 2)
  if num_steps is None:
    # t = u², weighted by dt/du = 2u: unbiased, and of finite variance, where t ~ U(0, 1] is not
    # (a token noised at small t has a reverse rate ~ 1/t, its square's t-integral diverges).
    total = (
      2.0 * u * continuous_loss_at(main_key, denoise_fn, x, schedule, u * u, editable=editable)
    )
  else:
    step = jnp.ceil(u * num_steps)  # i in {1, …, T}, uniform: u is in (0, 1].
    t, s = step / num_steps, (step - 1.0) / num_steps
    alpha_t, alpha_s = schedule.alpha(t), schedule.alpha(s)
    z_t = corrupt(main_key, x, alpha_t, vocab_size=vocab_size, editable=editable)
    probs = jnp.exp(_log_probs(denoise_fn, z_t, alpha_t))
    clean = jax.nn.one_hot(x, vocab_size, dtype=probs.dtype)
    kl = _kl_rows(
      reverse_probs(clean, z_t, alpha_t, alpha_s), reverse_probs(probs, z_t, alpha_t, alpha_s)
    )
    total = num_steps * jnp.where(editable, kl, 0.0).sum(-1)
  n_editable = editable.sum(-1)
  if schedule.needs_prior_term:
    total += n_editable * prior_kl(schedule.alpha_at_1, vocab_size)
  if schedule.needs_reconstruction_term:
    alpha_0 = jnp.full(x.shape[:1], schedule.alpha_at_0)
    z_0 = corrupt(recon_key, x, alpha_0, vocab_size=vocab_size, editable=editable)
    log_probs = _log_probs(denoise_fn, z_0, alpha_0)
    nll = -jnp.take_along_axis(log_probs, x[..., None], axis=-1)[..., 0]
    total += jnp.where(editable, nll, 0.0).sum(-1)
  return total


def keep_probabilities(alpha: Array, state: Array) -> Array:
  """[B, L]: each position's probability of holding its clean token, as a block's denoiser reads
  it, from state [B, L] (1: the block's editable positions, −1: later editable positions, 0:
  clean) and the block's α [B]: α, 0 (a uniform draw) and 1."""
  return jnp.where(state > 0, alpha[:, None], jnp.where(state < 0, 0.0, 1.0))


def block_nelbo(
  key: Array,
  denoise_fn: DenoiseFn,
  x: Array,
  schedule,
  block_size: int,
  *,
  vocab_size: int,
  editable: Optional[Array] = None,
  num_steps: Optional[int] = None,
  t_sampling: str = "stratified",
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
) -> Array:
  """Block diffusion's bound under uniform noise, nats [B]: Σ_k of block k's bound given the
  clean blocks before it, each with its own draws (`nelbo`'s, continuous or at T steps). The
  reference path over any denoiser, one call per block: denoise_fn(z, keep [B, L]) reads the
  clean prefix (keep 1), the noisy block (keep α(t)) and every later editable position as a
  uniform draw (keep 0); given positions show their token (keep 1). With the exact posterior
  under those emissions each block's term is unbiased for −log p(x_k | x_<k), so the sum is
  unbiased for −log p(x)."""
  editable = masking.editable_or_all(x, editable)
  block_of = jnp.arange(x.shape[1]) // block_size
  noise_key, key = jax.random.split(key)
  noise = uniform_tokens(row_keys(noise_key, x.shape[0], row_index), x.shape, vocab_size)

  def add_block(block, total):
    later = (block_of > block) & editable
    state = jnp.where(later, -1, ((block_of == block) & editable).astype(jnp.int32))

    def block_fn(z, alpha):
      return denoise_fn(jnp.where(later, noise, z), keep_probabilities(alpha, state))

    return total + nelbo(
      jax.random.fold_in(key, block),
      block_fn,
      x,
      schedule,
      vocab_size=vocab_size,
      editable=state > 0,
      num_steps=num_steps,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
    )

  return jax.lax.fori_loop(0, x.shape[1] // block_size, add_block, jnp.zeros(x.shape[:1]))


PairFn = Callable[[Array, Array, Array], Array]


def one_pass_block_nelbo(
  key: Array,
  pair_fn: PairFn,
  x: Array,
  schedule,
  block_size: int,
  *,
  editable: Optional[Array] = None,
  t_sampling: str = "stratified",
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
) -> Array:
  """One draw of `block_nelbo` (continuous time) from one call of the two-stream pass,
  pair_fn(z_t [B, L], x [B, L], keep [B, L]) -> logits of every noisy block given the clean
  blocks before it (`Transformer(block_size=b)(z_t, keep, clean=x)`; keep: each position's
  probability of holding its clean token, α(t_k) in block k, 1 at given positions). Each block
  draws its own t (stratified over the global batch per block), so its term is `nelbo`'s for
  that block; a schedule with α(0) < 1 costs a second pass for the reconstruction terms."""
  batch, length = x.shape
  if block_size < 1 or length % block_size:
    raise ValueError(f"block_size must divide the length {length}, got {block_size}.")
  editable = masking.editable_or_all(x, editable)
  time_key, draw_key = jax.random.split(key)
  u = jnp.stack(
    [
      sample_times(
        jax.random.fold_in(time_key, block),
        batch,
        t_sampling,
        row_index=row_index,
        num_rows=num_rows,
      )
      for block in range(length // block_size)
    ],
    axis=1,
  )  # [B, K]
  t = u * u  # As `nelbo`: t = u², weighted by 2u.
  per_position = lambda value: jnp.repeat(value, block_size, axis=1)
  alpha_blocks = schedule.alpha(t)
  alpha = per_position(alpha_blocks)
  mask_prob = per_position(schedule.mask_prob(t))
  rate = per_position(_jump_rate(schedule, t, alpha_blocks))
  main_key, recon_key = masking.split_keys(row_keys(draw_key, batch, row_index), 2)
  vocab_size = jax.eval_shape(pair_fn, x, x, alpha).shape[-1]
  z_t = corrupt(main_key, x, alpha, vocab_size=vocab_size, editable=editable)
  logits = pair_fn(z_t, x, jnp.where(editable, alpha, 1.0))
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  integrand = continuous_integrand(log_probs, x, z_t, alpha, mask_prob, rate)
  total = jnp.where(editable, per_position(2.0 * u) * integrand, 0.0).sum(-1)
  if schedule.needs_prior_term:
    total += editable.sum(-1) * prior_kl(schedule.alpha_at_1, vocab_size)
  if schedule.needs_reconstruction_term:
    alpha_0 = jnp.full(x.shape, schedule.alpha_at_0)
    z_0 = corrupt(recon_key, x, alpha_0, vocab_size=vocab_size, editable=editable)
    logits = pair_fn(z_0, x, jnp.where(editable, alpha_0, 1.0))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, x[..., None], axis=-1)[..., 0]
    total += jnp.where(editable, nll, 0.0).sum(-1)
  return total


def checked_nelbo(key, denoise_fn, x, schedule, *, refused, num_steps, block_size=None, **kwargs):
  """`bounds.nelbo(process="uniform")`: the bound, after refusing the masked process's options
  (refused: {name: (given, the only value taken)})."""
  for name, (given, only) in refused.items():
    if given != only:
      raise ValueError(
        f"nelbo: process='uniform' takes {name}={only!r} only (got {given!r}): that option is "
        "the masked process's."
      )
  if schedule.state_dependent:
    raise ValueError(
      f"nelbo: process='uniform' takes a mask-rate schedule, not {schedule.name!r} (GenMD4's)."
    )
  if num_steps is not None and (
    isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1
  ):
    raise ValueError(
      f"num_steps must be None (continuous time) or an integer >= 1, got {num_steps!r}."
    )
  if x.ndim != 2:
    raise ValueError(f"x must be [batch, length], got shape {x.shape}.")
  chex.assert_type(x, int, custom_message="nelbo: x must be integer token ids")
  if kwargs["editable"] is not None:
    chex.assert_shape(
      kwargs["editable"], x.shape, custom_message="nelbo: editable must have x's shape [B, L]"
    )
  logits = jax.eval_shape(denoise_fn, x, jnp.ones(x.shape[:1], jnp.float32))
  if logits.ndim != 3 or logits.shape[:2] != x.shape:
    raise ValueError(f"nelbo: the denoiser must return logits [B, L, V], got {logits.shape}.")
  if block_size is not None and (block_size < 1 or x.shape[1] % block_size):
    raise ValueError(f"block_size must divide the length {x.shape[1]}, got {block_size}.")
  if block_size is not None and block_size < x.shape[1]:
    return block_nelbo(
      key,
      denoise_fn,
      x,
      schedule,
      block_size,
      vocab_size=logits.shape[-1],
      num_steps=num_steps,
      **kwargs,
    )
  return nelbo(
    key, denoise_fn, x, schedule, vocab_size=logits.shape[-1], num_steps=num_steps, **kwargs
  )
