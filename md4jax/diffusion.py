"""Forward (masking) process and the masked-diffusion NELBO.

Pure functions over arrays and a denoiser callable (MATH.md has the formulas):

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

No truncation t ≥ ε is applied anywhere: t is drawn in (0, 1] and a weight
only multiplies positions that are masked.
"""

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from md4jax import schedules as schedules_lib

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (z_t [B, L], alpha_t [B]) -> logits [B, L, V]

ESTIMATORS = ("standard", "forced_target", "mask_count")
T_SAMPLINGS = ("uniform", "stratified")


def row_keys(key: Array, batch_size: int, row_index: Optional[Array] = None) -> Array:
  """One key per row [B, ...]: fold_in(key, row_index[b]) (default b), or `key` if it already is.

  Drawing each row from a key of its index in the global batch makes every
  draw independent of how the batch is split: over devices, processes or
  gradient-accumulation microbatches.
  """
  if _is_per_row(key):
    return key
  index = jnp.arange(batch_size) if row_index is None else row_index
  return jax.vmap(jax.random.fold_in, (None, 0))(key, index)


def _is_per_row(key: Array) -> bool:
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (1 if typed else 2)


def _uniform(key: Array, shape: tuple) -> Array:
  """U[0, 1) of `shape` [B, ...]; per-row keys draw each row from its own key."""
  if _is_per_row(key):
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)
  return jax.random.uniform(key, shape)


def _split(key: Array, num: int) -> tuple:
  """`num` independent keys (or per-row key arrays) from one."""
  if _is_per_row(key):
    return tuple(jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1))
  return tuple(jax.random.split(key, num))


def corrupt(key: Array, x: Array, alpha_t, *, mask_id: int, editable: Optional[Array] = None) -> Array:
  """Forward process q(z_t | x): keep each editable token with prob alpha_t, else mask it.

  Args:
    key: a PRNG key, or one key per row (`row_keys`).
    x: clean tokens [B, L].
    alpha_t: survival probability, a scalar or one per sequence [B].
    editable: bool [B, L]; False positions (padding, prompt) never change.
  Returns:
    z_t [B, L], same dtype as x.
  """
  alpha = jnp.asarray(alpha_t)
  if alpha.ndim == 1:
    alpha = alpha[:, None]
  keep = _uniform(key, x.shape) < alpha
  if editable is not None:
    keep = keep | ~editable
  return jnp.where(keep, x, mask_id).astype(x.dtype)


def _check_vocab(logits: Array, mask_id: int):
  if logits.shape[-1] != mask_id:
    raise ValueError(
        f"The denoiser returned {logits.shape[-1]} logits per position but mask_id is {mask_id}: "
        "logits must cover exactly the clean vocabulary [0, mask_id), with the mask id one past it.")


def subs_log_probs(logits: Array, z_t: Array, *, mask_id: int) -> Array:
  """SUBS parameterization: log p_θ(· | z_t) over the clean vocabulary [B, L, V].

  The one place where it is applied: the mask can never be predicted (there is
  no logit for it), and a visible position carries its token over with
  probability one (log-prob 0 on it, −inf elsewhere).
  """
  _check_vocab(logits, mask_id)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  visible = (z_t != mask_id)[..., None]
  carried = jnp.where(jax.nn.one_hot(z_t, mask_id, dtype=jnp.bool_), 0.0, -jnp.inf)
  return jnp.where(visible, carried, log_probs)


@jax.custom_vjp
def cross_entropy(logits: Array, labels: Array) -> Array:
  """−log softmax(logits)[label], [...] float32, for logits [..., V] of any float dtype.

  The math is float32, yet the backward pass keeps only the logits (in their
  own dtype) and the float32 log-normalizer [...]: no float32 [..., V] copy
  (of the logits or of the softmax) stays alive between the passes, which at
  V = 50k would be the largest buffer of a training step. Its gradient
  softmax − one_hot is recomputed elementwise, in one fused pass.
  """
  return _cross_entropy_forward(logits, labels)[0]


def _cross_entropy_forward(logits, labels):
  logits32 = logits.astype(jnp.float32)
  log_normalizer = jax.nn.logsumexp(logits32, axis=-1)
  label_logit = jnp.take_along_axis(logits32, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return log_normalizer - label_logit, (logits, labels, log_normalizer)


def _cross_entropy_backward(residuals, grad):
  logits, labels, log_normalizer = residuals
  probs = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
  one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
  return ((probs - one_hot) * grad[..., None]).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def masked_cross_entropy(logits: Array, x: Array, z_t: Array, *, mask_id: int) -> Array:
  """−log p_θ(x_ℓ | z_t) at masked positions, 0 at visible ones (never scored). [B, L].

  This is `subs_log_probs` read at x: a visible position's log-prob of its own
  token is 0, so only masked positions contribute, each with −log softmax.
  """
  _check_vocab(logits, mask_id)
  return jnp.where(z_t == mask_id, cross_entropy(logits, x), 0.0)


def sample_times(key: Array, batch_size: int, t_sampling: str = "stratified", *,
                 row_index: Optional[Array] = None, num_rows: Optional[int] = None) -> Array:
  """t in (0, 1], [B], for rows row_index (default 0..B−1) of a global batch of num_rows (default B).

  "stratified": t_b = 1 − ((u + row_index[b] / num_rows) mod 1), one u for the
  whole global batch, so each row's stratum comes from its global index;
  "uniform": independent t_b, each from its row's key. Either way a row's t
  does not depend on how the batch is split.
  """
  num_rows = batch_size if num_rows is None else num_rows
  index = jnp.arange(batch_size) if row_index is None else row_index
  if t_sampling == "uniform":
    u = _uniform(row_keys(key, batch_size, index), (batch_size,))
  elif t_sampling == "stratified":
    u = jnp.mod(jax.random.uniform(key, ()) + index / num_rows, 1.0)
  else:
    raise ValueError(f"Unknown t_sampling {t_sampling!r}; valid: {', '.join(T_SAMPLINGS)}.")
  return 1.0 - u  # u in [0, 1), so t is never 0 and the weight stays finite.


def _editable_or_all(x: Array, editable: Optional[Array]) -> Array:
  return jnp.ones(x.shape, jnp.bool_) if editable is None else editable.astype(jnp.bool_)


def _weighted_term(key, denoise_fn, x, alpha_t, editable, *, mask_id, estimator,
                   per_mask_weight, rate_weight) -> Array:
  """One Monte Carlo draw of a term rate_weight · h(1 − alpha_t), per sequence [B].

  "standard" scores every masked position with per_mask_weight = rate_weight / λ;
  "forced_target" forces one uniformly chosen editable position I masked and
  scores only it: E[CE_I | I masked] · n_editable = h(λ), so the weight is
  rate_weight · n_editable (seed 001, with −α′(t)/g(t) as rate_weight).
  """
  n_editable = editable.sum(-1)
  if estimator == "standard":
    z_t = corrupt(key, x, alpha_t, mask_id=mask_id, editable=editable)
    ce = masked_cross_entropy(denoise_fn(z_t, alpha_t), x, z_t, mask_id=mask_id)
    return per_mask_weight * ce.sum(-1)
  target_key, mask_key = _split(key, 2)
  scores = jnp.where(editable, _uniform(target_key, x.shape), -1.0)
  target = jnp.argmax(scores, axis=-1)  # Uniform among editable positions.
  forced = jax.nn.one_hot(target, x.shape[-1], dtype=jnp.bool_) & editable
  z_t = corrupt(mask_key, x, alpha_t, mask_id=mask_id, editable=editable & ~forced)
  z_t = jnp.where(forced, mask_id, z_t).astype(x.dtype)
  ce = masked_cross_entropy(denoise_fn(z_t, alpha_t), x, z_t, mask_id=mask_id)
  target_ce = jnp.take_along_axis(ce, target[:, None], axis=-1)[:, 0]
  return jnp.where(n_editable > 0, rate_weight * n_editable * target_ce, 0.0)


def continuous_loss_at(key: Array, denoise_fn: DenoiseFn, x: Array, schedule, t: Array, *,
                       mask_id: int, editable: Optional[Array] = None,
                       estimator: str = "standard") -> Array:
  """The continuous-time integrand at given times t [B]: w(t) Σ_masked CE, per sequence [B].

  Its mean over t ~ U(0, 1] is the schedule's part of L∞ (no endpoint terms).
  """
  editable = _editable_or_all(x, editable)
  return _weighted_term(key, denoise_fn, x, schedule.alpha(t), editable, mask_id=mask_id,
                        estimator=estimator, per_mask_weight=schedule.weight(t),
                        rate_weight=-schedule.dalpha(t))


def _discrete_term(key, denoise_fn, x, schedule, u, editable, *, num_steps, mask_id, estimator):
  """One draw of the discrete-time sum: step i uniform on 1..T (from u in (0, 1]), times T."""
  step = jnp.clip(jnp.ceil(u * num_steps), 1, num_steps)
  t, s = step / num_steps, (step - 1) / num_steps
  mask_rate_t = schedule.mask_prob(t)
  rate_weight = num_steps * (mask_rate_t - schedule.mask_prob(s))  # T (α(s) − α(t))
  return _weighted_term(key, denoise_fn, x, schedule.alpha(t), editable, mask_id=mask_id,
                        estimator=estimator, per_mask_weight=rate_weight / mask_rate_t,
                        rate_weight=rate_weight)


def _endpoint_term(key, denoise_fn, x, editable, low, high, *, mask_id, estimator):
  """One draw of ∫_low^high h(λ) dλ with λ uniform on (low, high]."""
  time_key, term_key = _split(key, 2)
  mask_rate = high - (high - low) * _uniform(time_key, (x.shape[0],))
  return _weighted_term(term_key, denoise_fn, x, 1.0 - mask_rate, editable, mask_id=mask_id,
                        estimator=estimator, per_mask_weight=(high - low) / mask_rate,
                        rate_weight=jnp.full_like(mask_rate, high - low))


def _mask_count_term(key, denoise_fn, x, u, editable, *, mask_id):
  """∫_0^1 h dλ with λ integrated out given the mask count k (bounded variance).

  Under λ ~ U(0, 1) the number k of masked editable positions is uniform on
  0..n, the masked set is a uniform k-subset, and, reweighted by 1/λ, λ | k is
  Beta(k, n − k + 1): the k-th smallest of the n uniforms that choose the set.
  Hence ∫ h dλ = E_{k ~ U{1..n}} [(n/k) Σ_{masked} CE(z, α = 1 − λ)], exact for
  any denoiser of (z, α), and with no 1/λ weight left.
  """
  n_editable = editable.sum(-1)
  num_masked = jnp.clip(jnp.ceil(u * n_editable), 1, None).astype(jnp.int32)
  scores = jnp.where(editable, _uniform(key, x.shape), 2.0)  # Non-editable sort last.
  order = jnp.argsort(scores, axis=-1)
  # Ranks, not a threshold: float32 uniforms tie often enough at long L to mask k + 1.
  masked = editable & (jnp.argsort(order, axis=-1) < num_masked[:, None])
  sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
  kth_smallest = jnp.take_along_axis(sorted_scores, num_masked[:, None] - 1, axis=-1)
  z = jnp.where(masked, mask_id, x).astype(x.dtype)
  alpha = 1.0 - jnp.minimum(kth_smallest[:, 0], 1.0)  # Sequences with nothing editable: α = 0.
  ce = masked_cross_entropy(denoise_fn(z, alpha), x, z, mask_id=mask_id)
  return jnp.where(n_editable > 0, n_editable / num_masked * ce.sum(-1), 0.0)


def nelbo(key: Array, denoise_fn: DenoiseFn, x: Array, schedule, *, mask_id: int,
          editable: Optional[Array] = None, num_steps: Optional[int] = None,
          estimator: str = "standard", t_sampling: str = "stratified",
          row_index: Optional[Array] = None, num_rows: Optional[int] = None) -> Array:
  """One-draw Monte Carlo estimate of the NELBO of each sequence, in nats, [B].

  Args:
    key: PRNG key. Row b draws from fold_in(key, row_index[b]) (and, stratified,
      from one u shared by the global batch), so its estimate depends on its
      global index only, never on how the batch is split.
    denoise_fn: (z_t, alpha_t) -> logits [B, L, mask_id].
    x: clean tokens [B, L] in [0, mask_id).
    schedule: a `md4jax.schedules` schedule (or its name).
    mask_id: the mask id, == V.
    editable: bool [B, L]; False positions (padding, prompt) are neither masked
      nor scored and do not count as tokens.
    num_steps: None for the continuous-time bound, an integer T for the
      discrete-time bound on the grid t_i = i/T (looser, → L∞ as T grows).
    estimator: "standard" (w(t) Σ_masked CE), "forced_target" (seed 001: one
      forced-masked target position, weight −α′(t) · n_editable), or
      "mask_count" (continuous only: uniform mask count, bounded variance).
    t_sampling: "uniform" or "stratified" (low-discrepancy over the batch).
    row_index: int [B], the rows' indices in the global batch (default 0..B−1).
    num_rows: the global batch size (default B); stratified t uses it.
  Returns:
    Per-sequence NELBO estimates [B] (float32); their mean is unbiased.
  """
  if isinstance(schedule, str):
    schedule = schedules_lib.get_schedule(schedule)
  if estimator not in ESTIMATORS:
    raise ValueError(f"Unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}.")
  if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                or num_steps < 1):
    raise ValueError(f"num_steps must be None (continuous time) or an integer >= 1, got {num_steps!r}.")
  if estimator == "mask_count" and num_steps is not None:
    raise ValueError("estimator='mask_count' estimates the continuous-time bound only; "
                     "use 'standard' or 'forced_target' with num_steps.")
  if x.ndim != 2:
    raise ValueError(f"x must be [batch, length], got shape {x.shape}.")
  editable = _editable_or_all(x, editable)
  time_key, draw_key = jax.random.split(key)
  u = sample_times(time_key, x.shape[0], t_sampling, row_index=row_index, num_rows=num_rows)
  main_key, recon_key, prior_key = _split(row_keys(draw_key, x.shape[0], row_index), 3)
  kwargs = dict(mask_id=mask_id)
  if estimator == "mask_count":
    return _mask_count_term(main_key, denoise_fn, x, u, editable, **kwargs)
  kwargs["estimator"] = estimator
  if num_steps is None:
    total = continuous_loss_at(main_key, denoise_fn, x, schedule, u, editable=editable, **kwargs)
  else:
    total = _discrete_term(main_key, denoise_fn, x, schedule, u, editable, num_steps=num_steps, **kwargs)
  if schedule.needs_reconstruction_term:
    total += _endpoint_term(recon_key, denoise_fn, x, editable, 0.0, 1.0 - schedule.alpha_at_0, **kwargs)
  if schedule.needs_prior_term:
    total += _endpoint_term(prior_key, denoise_fn, x, editable, 1.0 - schedule.alpha_at_1, 1.0, **kwargs)
  return total


def num_valid_tokens(x: Array, editable: Optional[Array] = None) -> Array:
  """Number of tokens each sequence is scored on, [B] (the per-token denominator)."""
  return _editable_or_all(x, editable).sum(-1)


def bits_per_token(total_nats, num_tokens):
  """NELBO in bits per valid token: divides by the valid-token count, never the mask count."""
  return total_nats / (num_tokens * math.log(2.0))


def perplexity(total_nats, num_tokens):
  """exp(NELBO per valid token): an upper bound on the true perplexity."""
  return jnp.exp(total_nats / num_tokens)
