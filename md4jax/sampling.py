"""Reverse-process samplers for masked diffusion LMs (MATH.md, "Reverse process").

Pure, traceable functions over any `denoise_fn(z, alpha) -> logits [B, L, V]`
with V == mask_id; loops are `lax.fori_loop` / `lax.while_loop`, so a caller
jits `sample` once with the model parameters as an argument:

  jax.jit(lambda key, params: sample(key, lambda z, a: model.apply(params, z, a), ...))

Methods:
  ancestral      the exact reverse step t → s on a time grid: every masked
                 position is revealed with prob (α(s) − α(t)) / (1 − α(t)) and
                 drawn from the denoiser; the last step reveals what is left.
  cached         ancestral that calls the network only when a step reveals
                 something and z changed since the last call. Token-for-token
                 equal to ancestral for a denoiser that ignores α; a
                 time-conditioned denoiser would see a stale α, so use
                 ancestral for those.
  first_hitting  exact, no discretization: with n masks at mask rate λ, the next
                 reveal happens at λ·u^(1/n) and reveals one uniformly chosen
                 masked position (one network call per masked position).
  confidence     MaskGIT-style heuristic (not the reverse process): each step
                 reveals the most confident masked positions, as many as the
                 schedule's mask rate says should remain masked.
"""

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from md4jax import categorical
from md4jax import diffusion

Array = jax.Array

METHODS = ("ancestral", "cached", "first_hitting", "confidence")
TIME_GRIDS = ("uniform", "cosine")
CONFIDENCES = ("max_prob", "margin", "neg_entropy")


def time_grid(num_steps: int, kind: str = "uniform") -> Array:
  """Times t_0 = 0 < t_1 < ... < t_T = 1, [T + 1]. "cosine" puts more steps near t = 0."""
  fraction = jnp.arange(num_steps + 1, dtype=jnp.float32) / num_steps
  if kind == "uniform":
    return fraction
  if kind == "cosine":
    return 1.0 - jnp.cos(0.5 * jnp.pi * fraction)
  raise ValueError(f"Unknown time grid {kind!r}; valid: {', '.join(TIME_GRIDS)}.")


def _initial_tokens(batch_size, length, mask_id, prompt, prompt_mask) -> Array:
  z = jnp.full((batch_size, length), mask_id, jnp.int32)
  if prompt is None:
    return z
  prompt = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (batch_size, length))
  if prompt_mask is None:
    prompt_mask = prompt != mask_id
  prompt_mask = jnp.broadcast_to(jnp.asarray(prompt_mask, jnp.bool_), (batch_size, length))
  return jnp.where(prompt_mask, prompt, z)


def _alphas(schedule, t, batch_size):
  return jnp.full((batch_size,), schedule.alpha(t), jnp.float32)


def _new_trajectory(z, num_records, vocab_size, top_k):
  """Empty recording of num_records steps: states [S + 1, B, L], top candidates [S, B, L, K], α [S, B]."""
  batch_size, length = z.shape
  top_k = min(top_k, vocab_size)
  return {
      "tokens": jnp.broadcast_to(z, (num_records + 1, batch_size, length)),
      "top_ids": jnp.zeros((num_records, batch_size, length, top_k), jnp.int32),
      "top_probs": jnp.zeros((num_records, batch_size, length, top_k), jnp.float32),
      "alphas": jnp.zeros((num_records, batch_size), jnp.float32),
  }


def _record(trajectory, index, z_after, logits, alpha):
  """Stores step `index`: the state after it and the denoiser's top candidates. No-op if None."""
  if trajectory is None:
    return None
  top_probs, top_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), trajectory["top_ids"].shape[-1])
  return {
      "tokens": trajectory["tokens"].at[index + 1].set(z_after),
      "top_ids": trajectory["top_ids"].at[index].set(top_ids),
      "top_probs": trajectory["top_probs"].at[index].set(top_probs),
      "alphas": trajectory["alphas"].at[index].set(alpha),
  }


def _reveal_probability(schedule, grid, step):
  """(α(s) − α(t)) / (1 − α(t)) from t = grid[step] to s = grid[step − 1]; 1 on the last step."""
  mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
  return jnp.where(step == 1, 1.0, (mask_t - mask_s) / mask_t)


def _ancestral(key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, cached, draw,
               trajectory):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, logits, cache_valid, nfe, trajectory = carry
    step = num_steps - i  # From T down to 1.
    step_key = jax.random.fold_in(key, step)
    reveal_key, draw_key = jax.random.split(step_key)
    reveal = (z == mask_id) & (jax.random.uniform(reveal_key, z.shape)
                               < _reveal_probability(schedule, grid, step))
    any_reveal = reveal.any()
    need_call = ~cache_valid & any_reveal if cached else jnp.bool_(True)
    alpha = _alphas(schedule, grid[step], batch_size)
    logits = jax.lax.cond(need_call, lambda: denoise_fn(z, alpha).astype(jnp.float32),
                          lambda: logits)
    z = jnp.where(reveal, draw(draw_key, logits), z)
    cache_valid = (cache_valid | need_call) & ~any_reveal
    trajectory = _record(trajectory, i, z, logits, alpha)
    return z, logits, cache_valid, nfe + need_call.astype(jnp.int32), trajectory

  logits = jnp.zeros(z.shape + (mask_id,), jnp.float32)
  init = (z, logits, jnp.bool_(False), jnp.int32(0), trajectory)
  z, _, _, nfe, trajectory = jax.lax.fori_loop(0, num_steps, body, init)
  return z, nfe, trajectory


def _first_hitting(key, denoise_fn, z, mask_id, draw, trajectory):
  batch_size, length = z.shape

  def cond(carry):
    return (carry[0] == mask_id).any()

  def body(carry):
    z, mask_rate, nfe, trajectory = carry
    event_key = jax.random.fold_in(key, nfe)
    time_key, position_key, draw_key = jax.random.split(event_key, 3)
    masked = z == mask_id
    num_masked = masked.sum(-1)
    u = jax.random.uniform(time_key, (batch_size,), minval=1e-12)  # Avoid λ = 0 exactly.
    mask_rate = jnp.where(num_masked > 0, mask_rate * u ** (1.0 / jnp.maximum(num_masked, 1)),
                          mask_rate)
    # The denoiser sees z just above the hitting time, with α at that time.
    alpha = 1.0 - mask_rate
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    scores = jnp.where(masked, jax.random.uniform(position_key, z.shape), -1.0)
    position = jax.nn.one_hot(jnp.argmax(scores, -1), length, dtype=jnp.bool_) & masked
    z = jnp.where(position, draw(draw_key, logits), z)
    return z, mask_rate, nfe + 1, _record(trajectory, nfe, z, logits, alpha)

  init = (z, jnp.ones((batch_size,), jnp.float32), jnp.int32(0), trajectory)
  z, _, nfe, trajectory = jax.lax.while_loop(cond, body, init)
  if trajectory is not None:  # Steps past the last event repeat the final state.
    after_end = jnp.arange(length + 1)[:, None, None] > nfe
    trajectory["tokens"] = jnp.where(after_end, z, trajectory["tokens"])
  return z, nfe, trajectory


def _confidence_scores(logits, kind):
  probs = jax.nn.softmax(logits, axis=-1)
  if kind == "max_prob":
    return probs.max(-1)
  if kind == "margin":
    top2 = jax.lax.top_k(probs, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if kind == "neg_entropy":
    return jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0), -1)
  raise ValueError(f"Unknown confidence {kind!r}; valid: {', '.join(CONFIDENCES)}.")


def _confidence(key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, draw, filtered,
                confidence, trajectory):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]
  initial_masked = (z == mask_id).sum(-1)

  def body(i, carry):
    z, trajectory = carry
    step = num_steps - i
    masked = z == mask_id
    alpha = _alphas(schedule, grid[step], batch_size)
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    # Masks to keep after this step: the schedule's share of the initial ones (0 at the end).
    share = schedule.mask_prob(grid[step - 1]) / schedule.mask_prob(grid[num_steps])
    keep = jnp.where(step == 1, 0, jnp.floor(initial_masked * share).astype(jnp.int32))
    num_reveal = jnp.maximum(masked.sum(-1) - keep, jnp.minimum(masked.sum(-1), 1))
    scores = jnp.where(masked, _confidence_scores(filtered(logits), confidence), -jnp.inf)
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)
    reveal = masked & (rank < num_reveal[:, None])
    z = jnp.where(reveal, draw(jax.random.fold_in(key, step), logits), z)
    return z, _record(trajectory, i, z, logits, alpha)

  z, trajectory = jax.lax.fori_loop(0, num_steps, body, (z, trajectory))
  return z, jnp.int32(num_steps), trajectory


def sample(key: Array, denoise_fn, *, batch_size: int, length: int, schedule, mask_id: int,
           method: str = "ancestral", num_steps: Optional[int] = None, temperature: float = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None,
           prompt: Optional[Array] = None, prompt_mask: Optional[Array] = None,
           time_grid_kind: str = "uniform", confidence: str = "max_prob",
           noise: str = "float64", record_trajectory: bool = False, trajectory_top_k: int = 5):
  """Generates [B, L] int32 tokens from all-mask (prompt positions given and clamped).

  Args:
    prompt, prompt_mask: tokens [L] or [B, L] and where they are given (default:
      wherever prompt != mask_id); those positions never change (infilling
      when they are scattered).
    num_steps: steps of the time grid; ignored by first_hitting. Required otherwise.
    noise: "float64" (accurate tails, default) or "float32" (for comparison only).
    record_trajectory: also return info["trajectory"]: "tokens" [S + 1, B, L]
      (the state before the first step and after each step), the denoiser's
      "top_ids" / "top_probs" [S, B, L, K] and "alphas" [S, B] at each step.
      S = num_steps, or L for first_hitting (steps past info["nfe"] repeat the end).
  Returns:
    (tokens [B, L] int32, info) with info["nfe"] the number of network calls for the batch.
  """
  if method not in METHODS:
    raise ValueError(f"Unknown sampling method {method!r}; valid: {', '.join(METHODS)}.")
  if method != "first_hitting" and (num_steps is None or num_steps < 1):
    raise ValueError(f"method={method!r} needs num_steps >= 1, got {num_steps!r}.")
  if noise not in categorical.NOISE_KINDS:
    raise ValueError(f"Unknown noise {noise!r}; valid: {', '.join(categorical.NOISE_KINDS)}.")
  filter_kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  categorical.filter_logits(jnp.zeros((1, 2)), **filter_kwargs)  # Validates the arguments early.
  for name, given in (("prompt", prompt), ("prompt_mask", prompt_mask)):
    if given is not None:
      chex.assert_rank(given, {1, 2}, custom_message=f"sample: {name} must be [L] or [B, L]")
      chex.assert_shape(given, (batch_size, length)[-jnp.ndim(given):],
                        custom_message=f"sample: {name} must be [length] or [batch_size, length]")
  denoise_fn = diffusion.checked_denoiser(denoise_fn, mask_id)

  def draw(draw_key, logits):
    return categorical.sample_categorical(draw_key, logits, noise=noise, **filter_kwargs)

  z = _initial_tokens(batch_size, length, mask_id, prompt, prompt_mask)
  trajectory = None
  if record_trajectory:
    num_records = length if method == "first_hitting" else num_steps
    trajectory = _new_trajectory(z, num_records, mask_id, trajectory_top_k)
  if method in ("ancestral", "cached"):
    tokens, nfe, trajectory = _ancestral(key, denoise_fn, z, schedule, mask_id, num_steps,
                                         time_grid_kind, method == "cached", draw, trajectory)
  elif method == "first_hitting":
    tokens, nfe, trajectory = _first_hitting(key, denoise_fn, z, mask_id, draw, trajectory)
  else:
    def filtered(logits):
      return categorical.filter_logits(logits, **filter_kwargs)
    tokens, nfe, trajectory = _confidence(key, denoise_fn, z, schedule, mask_id, num_steps,
                                          time_grid_kind, draw, filtered, confidence, trajectory)
  info = {"nfe": nfe}
  if trajectory is not None:
    info["trajectory"] = trajectory
  return tokens, info


def generate_semi_autoregressive(key: Array, denoise_fn, *, batch_size: int, total_length: int,
                                 context_length: int, block_length: int, schedule, mask_id: int,
                                 prompt: Optional[Array] = None, eos_id: Optional[int] = None,
                                 **sample_kwargs):
  """Generates past the model's context, MDLM style, block by block.

  The first window of `context_length` tokens is sampled from all-mask (with
  the prompt, a prefix [P] or [B, P], clamped). Each later window keeps the
  last context_length − block_length tokens as a clamped prefix and samples
  `block_length` new ones. With `eos_id`, generation stops once every sequence
  has an EOS, and tokens after a sequence's first EOS are set to EOS.
  `sample_kwargs` go to `sample` (method, num_steps, temperature, ...).

  Returns:
    (tokens [B, total_length] int32, info) with info["nfe"] (all blocks),
    info["num_blocks"] and info["lengths"] [B] (up to and including the first EOS).
  """
  if not 0 < block_length <= context_length:
    raise ValueError(f"Need 0 < block_length <= context_length, got {block_length}, {context_length}.")
  if total_length < 1:
    raise ValueError(f"total_length must be >= 1, got {total_length}.")
  window = min(context_length, total_length)
  prefix = jnp.zeros((batch_size, 0), jnp.int32)
  if prompt is not None:
    prefix = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (batch_size, jnp.shape(prompt)[-1]))
    if prefix.shape[1] > window:
      raise ValueError(f"The prompt ({prefix.shape[1]} tokens) is longer than the window ({window}).")

  @jax.jit
  def sample_window(window_key, given, given_mask):
    return sample(window_key, denoise_fn, batch_size=batch_size, length=window, schedule=schedule,
                  mask_id=mask_id, prompt=given, prompt_mask=given_mask, **sample_kwargs)

  def clamped(known):  # Window with `known` as its prefix and masks after it.
    pad = window - known.shape[1]
    given = jnp.concatenate([known, jnp.full((batch_size, pad), mask_id, jnp.int32)], axis=1)
    return given, jnp.arange(window) < known.shape[1]

  tokens, info = sample_window(jax.random.fold_in(key, 0), *clamped(prefix))
  nfe, num_blocks = int(info["nfe"]), 1
  keep = window - block_length
  while tokens.shape[1] < total_length:
    if eos_id is not None and bool(jnp.all(jnp.any(tokens == eos_id, axis=1))):
      break
    new, info = sample_window(jax.random.fold_in(key, num_blocks), *clamped(tokens[:, tokens.shape[1] - keep:]))
    tokens = jnp.concatenate([tokens, new[:, keep:]], axis=1)
    nfe, num_blocks = nfe + int(info["nfe"]), num_blocks + 1
  tokens = tokens[:, :total_length]
  lengths = jnp.full((batch_size,), tokens.shape[1], jnp.int32)
  if eos_id is not None:
    is_eos = tokens == eos_id
    lengths = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, lengths)
    tokens = jnp.where(jnp.arange(tokens.shape[1]) >= lengths[:, None], eos_id, tokens)
    if tokens.shape[1] < total_length:  # Stopped early: pad with EOS.
      tokens = jnp.pad(tokens, ((0, 0), (0, total_length - tokens.shape[1])), constant_values=eos_id)
  return tokens, {"nfe": nfe, "num_blocks": num_blocks, "lengths": lengths}
