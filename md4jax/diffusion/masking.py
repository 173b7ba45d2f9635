"""The forward masking process and the per-position scores every bound is built from.

Pure functions over arrays: per-row keys (a row's draws depend on its index in
the global batch only), q(z_t | x), the SUBS log-probs and a memory-lean
cross-entropy. `md4jax.diffusion.bounds` (the bounds) and `md4jax.diffusion.genmd4` (the
state-dependent bound) build on them.
"""

from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp

Array = jax.Array
DenoiseFn = Callable[[Array, Array], Array]  # (z_t [B, L], alpha_t or t [B]) -> logits [B, L, V]

T_SAMPLINGS = ("uniform", "stratified")


def row_keys(key: Array, batch_size: int, row_index: Optional[Array] = None) -> Array:
  """One key per row [B, ...]: fold_in(key, row_index[b]) (default b), or `key` if it already is.

  Drawing each row from a key of its index in the global batch makes every
  draw independent of how the batch is split: over devices, processes or
  gradient-accumulation microbatches.
  """
  if is_per_row(key):
    return key
  index = jnp.arange(batch_size) if row_index is None else row_index
  return jax.vmap(jax.random.fold_in, (None, 0))(key, index)


def is_per_row(key: Array) -> bool:
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (1 if typed else 2)


def uniform(key: Array, shape: tuple, minval: float = 0.0) -> Array:
  """U[minval, 1) of `shape` [B, ...]; per-row keys draw each row from its own key."""
  if is_per_row(key):
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], minval=minval))(key)
  return jax.random.uniform(key, shape, minval=minval)


def split_keys(key: Array, num: int) -> tuple:
  """`num` independent keys (or per-row key arrays) from one."""
  if is_per_row(key):
    return tuple(jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1))
  return tuple(jax.random.split(key, num))


def corrupt(
  key: Array, x: Array, alpha_t, *, mask_id: int, editable: Optional[Array] = None
) -> Array:
  """Forward process q(z_t | x): keep each editable token with prob alpha_t, else mask it.

  Args:
    key: a PRNG key, or one key per row (`row_keys`).
    x: clean tokens [B, L].
    alpha_t: survival probability, a scalar, one per sequence [B], or one per
      position [B, L] (a state-dependent schedule's α_{x_ℓ}(t)).
    editable: bool [B, L]; False positions (padding, prompt) never change.
  Returns:
    z_t [B, L], same dtype as x.
  """
  chex.assert_rank(x, 2, custom_message="corrupt: x must be clean tokens [B, L]")
  chex.assert_type(x, int, custom_message="corrupt: x must be integer token ids")
  alpha = jnp.asarray(alpha_t)
  chex.assert_rank(
    alpha, {0, 1, 2}, custom_message="corrupt: alpha_t must be a scalar, [B] or [B, L]"
  )
  if alpha.ndim == 2:
    chex.assert_shape(alpha, x.shape, custom_message="corrupt: per-position alpha_t must be [B, L]")
  elif alpha.ndim == 1:
    chex.assert_shape(alpha, x.shape[:1], custom_message="corrupt: alpha_t must be [B]")
    alpha = alpha[:, None]
  keep = uniform(key, x.shape) < alpha
  if editable is not None:
    keep = keep | ~editable
  return jnp.where(keep, x, mask_id).astype(x.dtype)


def checked_denoiser(denoise_fn: DenoiseFn, mask_id: int) -> DenoiseFn:
  """denoise_fn whose output must be logits [B, L, mask_id] (checked once, at trace time)."""

  def checked(z_t, alpha_t):
    logits = denoise_fn(z_t, alpha_t)
    check_vocab(logits, mask_id)
    chex.assert_shape(
      logits,
      z_t.shape + (mask_id,),
      custom_message="denoise_fn(z_t [B, L], alpha_t) must return logits [B, L, V]",
    )
    return logits

  return checked


def check_vocab(logits: Array, mask_id: int):
  if logits.shape[-1] != mask_id:
    raise ValueError(
      f"The denoiser returned {logits.shape[-1]} logits per position but mask_id is {mask_id}: "
      "logits must cover exactly the clean vocabulary [0, mask_id), with the mask id one past it."
    )


def subs_log_probs(logits: Array, z_t: Array, *, mask_id: int) -> Array:
  """SUBS parameterization: log p_θ(· | z_t) over the clean vocabulary [B, L, V].

  The one place where it is applied: the mask can never be predicted (there is
  no logit for it), and a visible position carries its token over with
  probability one (log-prob 0 on it, −inf elsewhere).
  """
  check_vocab(logits, mask_id)
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
  check_vocab(logits, mask_id)
  return jnp.where(z_t == mask_id, cross_entropy(logits, x), 0.0)


def sample_times(
  key: Array,
  batch_size: int,
  t_sampling: str = "stratified",
  *,
  row_index: Optional[Array] = None,
  num_rows: Optional[int] = None,
) -> Array:
  """t in (0, 1], [B], for rows row_index (default 0..B−1) of a global batch of num_rows (default B).

  "stratified": t_b = 1 − ((u + row_index[b] / num_rows) mod 1), one u for the
  whole global batch, so each row's stratum comes from its global index;
  "uniform": independent t_b, each from its row's key. Either way a row's t
  does not depend on how the batch is split.
  """
  num_rows = batch_size if num_rows is None else num_rows
  index = jnp.arange(batch_size) if row_index is None else row_index
  if t_sampling == "uniform":
    u = uniform(row_keys(key, batch_size, index), (batch_size,))
  elif t_sampling == "stratified":
    u = jnp.mod(jax.random.uniform(key, ()) + index / num_rows, 1.0)
  else:
    raise ValueError(f"Unknown t_sampling {t_sampling!r}; valid: {', '.join(T_SAMPLINGS)}.")
  return 1.0 - u  # u in [0, 1), so t is never 0 and the weight stays finite.


def clipped_times(t: Array, schedule, mask_rates: Optional[tuple]) -> Array:
  """BD3-LM's clipped schedule: the times whose mask rate 1 − α(t) is β + (ω − β) t, uniform on
  [β, ω] for t uniform (mask_rates = (β, ω)); t itself for None."""
  if mask_rates is None:
    return t
  low, high = mask_rates
  return schedule.time_of(1.0 - (low + (high - low) * t))


def editable_or_all(x: Array, editable: Optional[Array]) -> Array:
  return jnp.ones(x.shape, jnp.bool_) if editable is None else editable.astype(jnp.bool_)
