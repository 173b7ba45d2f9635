"""Reverse-process samplers for masked diffusion LMs (docs/math.md, "Reverse process").

Pure, traceable functions over any `denoise_fn(z, alpha) -> logits [B, L, V]`
with V == mask_id; loops are `lax.fori_loop` / `lax.while_loop`. `sample` called with
concrete arrays compiles once per denoiser and settings and checks the logits; a caller
who changes the model parameters jits it once with them as an argument:

  jax.jit(lambda key, params: sample(key, lambda z, a: model.apply(params, z, a), ...))

Every loop is bounded by the calls its method states (`max_calls`): the adaptive ones
(jump, first_hitting, confidence, threshold) reveal at least one masked position of every
unfinished row per call, whatever the logits, and no method returns the mask id. Logits
with a NaN or +inf, or with no finite value, at a masked position are reported
(info["nonfinite_call"]) and raised as NonFiniteLogitsError.

Methods:
  ancestral      the exact reverse step t → s on a time grid: every masked
                 position is revealed with prob (α(s) − α(t)) / (1 − α(t)) and
                 drawn from the denoiser; the last step reveals what is left.
  cached         ancestral that calls the network only when a step reveals
                 something and z changed since the last call. Token-for-token
                 equal to ancestral for a denoiser that ignores α; a
                 time-conditioned denoiser would see a stale α, so use
                 ancestral for those.
  jump           exactly ancestral with T steps, for a time-free denoiser, at
                 ~min(T, L) calls: a step that reveals nothing leaves z (and
                 the logits) unchanged, so each sequence jumps straight to its
                 next step that reveals something. With n masks at step i the
                 steps i..k all reveal nothing with prob (λ(t_{k−1}) / λ(t_i))^n,
                 so that step is found from one uniform (as in first-hitting,
                 then located on the grid), and its reveals are the step's
                 independent Bernoulli(r) draws conditioned on ≥ 1. One call
                 serves every sequence's next event.
  first_hitting  exact, no discretization: with n masks at mask rate λ, the next
                 reveal happens at λ·u^(1/n) and reveals one uniformly chosen
                 masked position (one network call per masked position).
  confidence     MaskGIT-style heuristic (not the reverse process): each step
                 reveals the most confident masked positions, as many as the
                 schedule's mask rate says should remain masked, and at least
                 one per sequence; it stops when nothing is masked (≤ min(T, L) calls).
  threshold      Fast-dLLM parallel decoding (a heuristic): each call reveals
                 every masked position whose top probability (under the
                 temperature / top-k / top-p law; at temperature 0, the plain
                 softmax) is ≥ `threshold`, and at least the most confident one
                 per sequence; revealed tokens are drawn from that law. (A
                 recorded trajectory's top_probs are the unfiltered softmax.)

  remdm          ReMDM (Wang et al. 2025): ancestral steps in which a visible token is
                 masked again with prob σ_t (`remask` strategy, `remask_eta`), and masked
                 ones revealed a little more often, so the forward marginals are kept; σ = 0
                 is ancestral, token for token. `remask_loop` extra steps at a fixed α
                 (ReMDM-loop) keep improving a sample after the grid has revealed most of it.

A state-dependent schedule (GenMD4) samples with "ancestral" only, and its
denoiser is called as denoise_fn(z, t [B]). From t to s, a masked position
whose clean value is v stays masked with prob (1 − α_v(s)) / (1 − α_v(t))
(the forward process, read backwards), so given the prediction μ it is
revealed as v with prob μ_v (α_v(s) − α_v(t)) / (1 − α_v(t)) and stays masked
with prob Σ_v μ_v (1 − α_v(s)) / (1 − α_v(t)): one categorical over V + 1
outcomes, the last of which (id V = mask_id) is "stay masked". μ is the
denoiser's law after temperature / top-k / top-p.
"""

import dataclasses
import functools
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion import bounds
from md4jax.sampling import categorical

Array = jax.Array

METHODS = ("ancestral", "cached", "jump", "first_hitting", "confidence", "threshold", "remdm")
TIME_FREE_METHODS = ("cached", "jump")  # Exact only for a denoiser that ignores α.
TIME_GRIDS = ("uniform", "cosine")
CONFIDENCES = ("max_prob", "margin", "neg_entropy")
REMASKS = ("cap", "rescale", "confidence")  # ReMDM's σ_t strategies.


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
  given = prompt != mask_id  # A position holding the mask id is filled, whatever prompt_mask says.
  if prompt_mask is not None:
    given &= jnp.broadcast_to(jnp.asarray(prompt_mask, jnp.bool_), (batch_size, length))
  return jnp.where(given, prompt, z)


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
  top_probs, top_ids = jax.lax.top_k(
    jax.nn.softmax(logits, axis=-1), trajectory["top_ids"].shape[-1]
  )
  return {
    "tokens": trajectory["tokens"].at[index + 1].set(z_after),
    "top_ids": trajectory["top_ids"].at[index].set(top_ids),
    "top_probs": trajectory["top_probs"].at[index].set(top_probs),
    "alphas": trajectory["alphas"].at[index].set(alpha),
  }


def _nonfinite_rows(logits, z, mask_id):
  """[B] bool: a masked position of the row got a NaN or +inf logit, or no finite one."""
  broken = jnp.isnan(logits).any(-1) | (logits == jnp.inf).any(-1) | ~jnp.isfinite(logits).any(-1)
  return (broken & (z == mask_id)).any(-1)


def _first_bad_call(first_bad, call, bad_rows):
  """The index of the first call whose logits were broken (−1 while none was)."""
  return jnp.where((first_bad < 0) & bad_rows.any(), call, first_bad)


def _masked_scores(scores, masked):
  """Scores of masked positions, finite and above every unmasked position's (−inf): a NaN or
  −inf score (from broken logits) still ranks a masked position before any visible one."""
  lowest = jnp.finfo(jnp.float32).min
  return jnp.where(masked, jnp.nan_to_num(scores, nan=lowest, neginf=lowest), -jnp.inf)


def _reveal_probability(schedule, grid, step):
  """(α(s) − α(t)) / (1 − α(t)) from t = grid[step] to s = grid[step − 1]; 1 on the last step."""
  mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
  return jnp.where(step == 1, 1.0, (mask_t - mask_s) / mask_t)


def _ancestral(
  key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, cached, draw, trajectory
):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, logits, cache_valid, nfe, first_bad, trajectory = carry
    step = num_steps - i  # From T down to 1.
    step_key = jax.random.fold_in(key, step)
    reveal_key, draw_key = jax.random.split(step_key)
    reveal = (z == mask_id) & (
      jax.random.uniform(reveal_key, z.shape) < _reveal_probability(schedule, grid, step)
    )
    any_reveal = reveal.any()
    need_call = ~cache_valid & any_reveal if cached else jnp.bool_(True)
    alpha = _alphas(schedule, grid[step], batch_size)
    logits = jax.lax.cond(
      need_call, lambda: denoise_fn(z, alpha).astype(jnp.float32), lambda: logits
    )
    first_bad = _first_bad_call(first_bad, nfe, need_call & _nonfinite_rows(logits, z, mask_id))
    z = jnp.where(reveal, draw(draw_key, logits), z)
    cache_valid = (cache_valid | need_call) & ~any_reveal
    trajectory = _record(trajectory, i, z, logits, alpha)
    return z, logits, cache_valid, nfe + need_call.astype(jnp.int32), first_bad, trajectory

  logits = jnp.zeros(z.shape + (mask_id,), jnp.float32)
  init = (z, logits, jnp.bool_(False), jnp.int32(0), jnp.int32(-1), trajectory)
  z, _, _, nfe, first_bad, trajectory = jax.lax.fori_loop(0, num_steps, body, init)
  return z, nfe, first_bad, trajectory


def _state_dependent_ancestral(
  key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, filtered, noise, trajectory
):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, first_bad, trajectory = carry
    step = num_steps - i
    time = jnp.full((batch_size,), grid[step], jnp.float32)
    logits = denoise_fn(z, time).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, i, _nonfinite_rows(logits, z, mask_id))
    mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
    # P(still masked at s | masked at t, value v) [V]; 0 on the last step (α_v(0) = 1).
    stay = jnp.where((step > 1) & (mask_t > 0), mask_s / jnp.where(mask_t > 0, mask_t, 1.0), 0.0)
    probs = filtered(logits)
    outcome_probs = jnp.concatenate(
      [probs * (1.0 - stay), jnp.sum(probs * stay, axis=-1, keepdims=True)], axis=-1
    )
    outcome_logits = jnp.log(jnp.maximum(outcome_probs, 0.0))
    outcome = categorical.sample_categorical(
      jax.random.fold_in(key, step), outcome_logits, noise=noise
    )
    z = jnp.where(z == mask_id, outcome, z)  # Outcome mask_id: stays masked.
    return z, first_bad, _record(trajectory, i, z, logits, time)

  z, first_bad, trajectory = jax.lax.fori_loop(0, num_steps, body, (z, jnp.int32(-1), trajectory))
  return z, jnp.int32(num_steps), first_bad, trajectory


def _remask_probability(strategy, eta, alpha_t, mask_s, weights):
  """ReMDM's σ_t: the probability that a visible token is masked again from t to s.

  The remasking posterior keeps q(z_s | x) for any σ_t ≤ σ_max = min(1, (1 − α_s) / α_t):
  "cap" min(η, σ_max), "rescale" η σ_max, and "confidence" weights^ℓ σ_max with weights a
  softmax over the visible tokens of minus the probability each was drawn with ([B, L]).
  """
  sigma_max = jnp.where(
    alpha_t > 0, jnp.minimum(1.0, mask_s / jnp.where(alpha_t > 0, alpha_t, 1.0)), 1.0
  )
  if strategy == "cap":
    return jnp.minimum(eta, sigma_max)
  if strategy == "rescale":
    return eta * sigma_max
  return weights * sigma_max


def _remdm(
  key,
  denoise_fn,
  z,
  schedule,
  mask_id,
  num_steps,
  grid_kind,
  draw,
  probs,
  strategy,
  eta,
  loop_steps,
  loop_alpha,
  trajectory,
):
  """ReMDM (Wang et al. 2025): ancestral steps in which visible tokens may be masked again.

  From t to s a visible token is masked with prob σ_t and a masked one revealed with prob
  (α_s − (1 − σ_t) α_t) / (1 − α_t), which keeps the forward marginals; σ_t = 0 is ancestral,
  token for token (the same keys). With loop_steps > 0 (ReMDM-loop), the grid's steps do not
  remask; after the first step that reaches α ≥ loop_alpha, loop_steps more steps run at that
  fixed α, each remasking with the strategy's σ. Prompt positions are never masked.
  """
  grid = time_grid(num_steps, grid_kind)
  mask_grid = schedule.mask_prob(grid)
  batch_size = z.shape[0]
  editable = z == mask_id
  # The grid step after which the loop runs: the first (from t = 1) whose s has α ≥ loop_alpha,
  # and at the latest the one before the last step (the last reveals everything).
  reached = (1.0 - mask_grid[:-1]) >= loop_alpha  # [T]: α(t_{k−1}) ≥ loop_alpha, k = 1..T.
  loop_after = jnp.maximum(jnp.max(jnp.where(reached, jnp.arange(1, num_steps + 1), 0)), 2)
  loop_start = num_steps - loop_after + 1  # Iterations before the loop.

  def body(i, carry):
    z, confidence, first_bad, trajectory = carry
    in_loop = (loop_steps > 0) & (i >= loop_start) & (i < loop_start + loop_steps)
    after_loop = (loop_steps > 0) & (i >= loop_start + loop_steps)
    step = jnp.where(after_loop, num_steps - (i - loop_steps), num_steps - i)
    step = jnp.where(in_loop, loop_after - 1, step)  # Held at α(t_{k*−1}).
    step_key = jnp.where(
      in_loop, jax.random.fold_in(key, num_steps + 1 + i), jax.random.fold_in(key, step)
    )
    reveal_key, draw_key = jax.random.split(step_key)
    mask_t = mask_grid[step]
    mask_s = jnp.where(in_loop, mask_t, mask_grid[step - 1])
    alpha_t = 1.0 - mask_t
    visible = editable & (z != mask_id)
    weights = jax.nn.softmax(jnp.where(visible, confidence, -jnp.inf), axis=-1)
    weights = jnp.where(visible, jnp.nan_to_num(weights), 0.0)
    sigma = _remask_probability(strategy, eta, alpha_t, mask_s, weights)
    sigma = jnp.where((loop_steps > 0) & ~in_loop, 0.0, sigma)
    sigma = jnp.broadcast_to(sigma, z.shape)
    masked = z == mask_id
    # Masked positions: ancestral's reveal, plus σ α_t / (1 − α_t) for the tokens remasked
    # (confidence: σ = 0 there, as ReMDM's); 1 on the last step.
    masked_sigma = 0.0 if strategy == "confidence" else sigma
    base = jnp.where(in_loop, 0.0, _reveal_probability(schedule, grid, step))
    reveal_prob = jnp.where(
      (step == 1) & ~in_loop, 1.0, base + masked_sigma * alpha_t / jnp.maximum(mask_t, 1e-30)
    )
    reveal = masked & (jax.random.uniform(reveal_key, z.shape) < reveal_prob)
    remask = visible & (jax.random.uniform(jax.random.fold_in(step_key, 2), z.shape) < sigma)
    alpha = _alphas(schedule, grid[step], batch_size)
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, i, _nonfinite_rows(logits, z, mask_id))
    drawn = draw(draw_key, logits)
    drawn_prob = jnp.take_along_axis(probs(logits), drawn[..., None], axis=-1)[..., 0]
    z = jnp.where(reveal, drawn, jnp.where(remask, mask_id, z))
    confidence = jnp.where(reveal, -drawn_prob, jnp.where(remask, -jnp.inf, confidence))
    trajectory = _record(trajectory, i, z, logits, alpha)
    return z, confidence, first_bad, trajectory

  total = num_steps + loop_steps
  init = (z, jnp.full(z.shape, -jnp.inf, jnp.float32), jnp.int32(-1), trajectory)
  z, _, first_bad, trajectory = jax.lax.fori_loop(0, total, body, init)
  return z, jnp.int32(total), first_bad, trajectory


def _reveal_at_least_one(key, masked, reveal_prob):
  """Each masked position revealed with prob r, conditioned on at least one, [B, L] bool. Exact:
  in a uniformly random order, the first revealed one is at K ~ Geometric(r) truncated to 1..n
  (drawn by inverse CDF, in logs), and every later one is revealed with prob r on its own."""
  order_key, first_key, rest_key = jax.random.split(key, 3)
  n = masked.sum(-1)
  scores = jnp.where(masked, jax.random.uniform(order_key, masked.shape), -1.0)
  rank = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)  # 0..n−1 over the masked positions.
  log_keep = jnp.log1p(-jnp.minimum(reveal_prob, 1.0))[:, None]  # log(1 − r); −inf when r = 1.
  u = jax.random.uniform(first_key, n.shape)[:, None]
  all_kept = -jnp.expm1(n[:, None] * log_keep)  # 1 − (1 − r)^n
  first = jnp.ceil(jnp.log1p(-u * all_kept) / log_keep) - 1  # 0-based rank of the first reveal.
  first = jnp.clip(jnp.nan_to_num(first, nan=0.0), 0, jnp.maximum(n[:, None] - 1, 0))
  later = jax.random.uniform(rest_key, masked.shape) < reveal_prob[:, None]
  return masked & ((rank == first) | ((rank > first) & later))


def _jump(key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, draw, trajectory):
  grid = time_grid(num_steps, grid_kind)
  mask_grid = schedule.mask_prob(grid)  # λ(t_0) ≤ ... ≤ λ(t_T), [T + 1].
  batch_size, length = z.shape
  max_calls = min(num_steps, length)  # Each call moves every unfinished row ≥ 1 step, ≥ 1 reveal.

  def cond(carry):
    return (carry[2] < max_calls) & (carry[0] == mask_id).any()

  def body(carry):
    z, step, nfe, first_bad, trajectory = carry  # step [B]: the next grid step each row processes.
    hit_key, reveal_key, draw_key = jax.random.split(jax.random.fold_in(key, nfe), 3)
    masked = z == mask_id
    n = masked.sum(-1)
    u = jax.random.uniform(hit_key, (batch_size,), minval=1e-12)
    # Steps step..k reveal nothing with prob (λ(t_{k−1}) / λ(t_step))^n: the event step j has
    # λ(t_{j−1}) < λ(t_step) u^(1/n) ≤ λ(t_j) (the last step, j = 1, reveals all that is left).
    target = mask_grid[step] * u ** (1.0 / jnp.maximum(n, 1))
    # Finished rows (step 0) keep event 1: nothing of theirs is masked, nothing changes.
    event = jnp.clip(jnp.searchsorted(mask_grid, target, side="left"), 1, jnp.maximum(step, 1))
    reveal_prob = jnp.where(
      event == 1,
      1.0,
      (mask_grid[event] - mask_grid[event - 1]) / jnp.maximum(mask_grid[event], 1e-30),
    )
    reveal = _reveal_at_least_one(reveal_key, masked, reveal_prob)
    alpha = schedule.alpha(grid[event]).astype(jnp.float32)
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, nfe, _nonfinite_rows(logits, z, mask_id))
    z = jnp.where(reveal, draw(draw_key, logits), z)
    step = jnp.where(n > 0, event - 1, step)
    return z, step, nfe + 1, first_bad, _record(trajectory, nfe, z, logits, alpha)

  init = (z, jnp.full((batch_size,), num_steps, jnp.int32), jnp.int32(0), jnp.int32(-1), trajectory)
  z, _, nfe, first_bad, trajectory = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, _repeat_final(trajectory, z, nfe)


def _repeat_final(trajectory, z, nfe):
  """Recorded steps past the last call repeat the final state."""
  if trajectory is not None:
    after_end = jnp.arange(trajectory["tokens"].shape[0])[:, None, None] > nfe
    trajectory["tokens"] = jnp.where(after_end, z, trajectory["tokens"])
  return trajectory


def _threshold(key, denoise_fn, z, mask_id, threshold, draw, filtered, trajectory):
  length = z.shape[1]

  def cond(carry):  # Each call reveals ≥ 1 position of every unfinished row: ≤ L calls.
    return (carry[1] < length) & (carry[0] == mask_id).any()

  def body(carry):
    z, nfe, first_bad, trajectory = carry
    masked = z == mask_id
    alpha = 1.0 - masked.sum(-1) / length  # The share already revealed.
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, nfe, _nonfinite_rows(logits, z, mask_id))
    top = _masked_scores(jax.nn.softmax(filtered(logits), axis=-1).max(-1), masked)
    # The most confident masked position: argmax over top, where a broken (NaN) score of a
    # masked position still beats every visible one (a visible "best" would reveal nothing).
    best = jax.nn.one_hot(jnp.argmax(top, -1), length, dtype=jnp.bool_)
    reveal = masked & ((top >= threshold) | best)
    z = jnp.where(reveal, draw(jax.random.fold_in(key, nfe), logits), z)
    return z, nfe + 1, first_bad, _record(trajectory, nfe, z, logits, alpha)

  init = (z, jnp.int32(0), jnp.int32(-1), trajectory)
  z, nfe, first_bad, trajectory = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, _repeat_final(trajectory, z, nfe)


def _first_hitting(key, denoise_fn, z, mask_id, draw, trajectory):
  batch_size, length = z.shape

  def cond(carry):  # One reveal per unfinished row and call: ≤ L calls.
    return (carry[2] < length) & (carry[0] == mask_id).any()

  def body(carry):
    z, mask_rate, nfe, first_bad, trajectory = carry
    event_key = jax.random.fold_in(key, nfe)
    time_key, position_key, draw_key = jax.random.split(event_key, 3)
    masked = z == mask_id
    num_masked = masked.sum(-1)
    u = jax.random.uniform(time_key, (batch_size,), minval=1e-12)  # Avoid λ = 0 exactly.
    mask_rate = jnp.where(
      num_masked > 0, mask_rate * u ** (1.0 / jnp.maximum(num_masked, 1)), mask_rate
    )
    # The denoiser sees z just above the hitting time, with α at that time.
    alpha = 1.0 - mask_rate
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, nfe, _nonfinite_rows(logits, z, mask_id))
    scores = jnp.where(masked, jax.random.uniform(position_key, z.shape), -1.0)
    position = jax.nn.one_hot(jnp.argmax(scores, -1), length, dtype=jnp.bool_) & masked
    z = jnp.where(position, draw(draw_key, logits), z)
    return z, mask_rate, nfe + 1, first_bad, _record(trajectory, nfe, z, logits, alpha)

  init = (z, jnp.ones((batch_size,), jnp.float32), jnp.int32(0), jnp.int32(-1), trajectory)
  z, _, nfe, first_bad, trajectory = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, _repeat_final(trajectory, z, nfe)


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


def _confidence(
  key,
  denoise_fn,
  z,
  schedule,
  mask_id,
  num_steps,
  grid_kind,
  draw,
  filtered,
  confidence,
  trajectory,
):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]
  initial_masked = (z == mask_id).sum(-1)

  # Each step reveals at least one mask per sequence, so with T > L the batch is done before
  # step T; the steps after that would change nothing, and are not run.
  def cond(carry):
    i, z, _, _ = carry
    return (i < num_steps) & (z == mask_id).any()

  def body(carry):
    i, z, first_bad, trajectory = carry
    step = num_steps - i
    masked = z == mask_id
    alpha = _alphas(schedule, grid[step], batch_size)
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    first_bad = _first_bad_call(first_bad, i, _nonfinite_rows(logits, z, mask_id))
    # Masks to keep after this step: the schedule's share of the initial ones (0 at the end).
    share = schedule.mask_prob(grid[step - 1]) / schedule.mask_prob(grid[num_steps])
    keep = jnp.where(step == 1, 0, jnp.floor(initial_masked * share).astype(jnp.int32))
    num_reveal = jnp.maximum(masked.sum(-1) - keep, jnp.minimum(masked.sum(-1), 1))
    # Masked positions rank first whatever their scores (NaN ones last among them), so the
    # step reveals num_reveal masked positions and the last step all that are left.
    scores = _masked_scores(_confidence_scores(filtered(logits), confidence), masked)
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)
    reveal = masked & (rank < num_reveal[:, None])
    z = jnp.where(reveal, draw(jax.random.fold_in(key, step), logits), z)
    return i + 1, z, first_bad, _record(trajectory, i, z, logits, alpha)

  init = (jnp.int32(0), z, jnp.int32(-1), trajectory)
  nfe, z, first_bad, trajectory = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, _repeat_final(trajectory, z, nfe)


class NonFiniteLogitsError(ValueError):
  """The denoiser returned logits no token can be drawn from: the samples would be meaningless."""


# Network calls a method makes at most, for a batch of L positions and T steps. Every unfinished
# row reveals at least one masked position per call of the adaptive methods.
def max_calls(method: str, length: int, num_steps: Optional[int], remask_loop: int = 0) -> int:
  if method in ("ancestral", "cached"):
    return num_steps
  if method == "remdm":
    return num_steps + remask_loop
  if method in ("jump", "confidence"):
    return min(num_steps, length)
  return length  # first_hitting, threshold.


@dataclasses.dataclass(frozen=True)
class _Setting:
  """Everything but the key and the prompt: static for jit, one hashable cache key."""

  denoise_fn: Callable
  batch_size: int
  length: int
  schedule: object
  mask_id: int
  method: str
  num_steps: Optional[int]
  temperature: float
  top_k: Optional[int]
  top_p: Optional[float]
  time_grid_kind: str
  confidence: str
  threshold: Optional[float]
  noise: str
  record_trajectory: bool
  trajectory_top_k: int
  remask: str
  remask_eta: float
  remask_loop: int
  remask_loop_alpha: float
  guidance_scale: float

  def filtered(self, logits):
    return categorical.filter_logits(
      logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
    )

  def draw(self, key, logits):
    return categorical.sample_categorical(
      key,
      logits,
      noise=self.noise,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
    )

  def probs(self, logits):
    if self.temperature == 0:  # Greedy: all mass on the top token.
      return jax.nn.one_hot(jnp.argmax(logits, -1), self.mask_id, dtype=jnp.float32)
    return jax.nn.softmax(self.filtered(logits), axis=-1)


# One signature for every sampler: (setting, key, denoise_fn, z, trajectory) ->
# (tokens, calls, first broken call or −1, trajectory).
_SAMPLERS = {
  "ancestral": lambda s, key, f, z, tr: _ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, False, s.draw, tr
  ),
  "cached": lambda s, key, f, z, tr: _ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, True, s.draw, tr
  ),
  "jump": lambda s, key, f, z, tr: _jump(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, s.draw, tr
  ),
  "first_hitting": lambda s, key, f, z, tr: _first_hitting(key, f, z, s.mask_id, s.draw, tr),
  "confidence": lambda s, key, f, z, tr: _confidence(
    key,
    f,
    z,
    s.schedule,
    s.mask_id,
    s.num_steps,
    s.time_grid_kind,
    s.draw,
    s.filtered,
    s.confidence,
    tr,
  ),
  "threshold": lambda s, key, f, z, tr: _threshold(
    key, f, z, s.mask_id, s.threshold, s.draw, s.filtered, tr
  ),
  "remdm": lambda s, key, f, z, tr: _remdm(
    key,
    f,
    z,
    s.schedule,
    s.mask_id,
    s.num_steps,
    s.time_grid_kind,
    s.draw,
    s.probs,
    s.remask,
    s.remask_eta,
    s.remask_loop,
    s.remask_loop_alpha,
    tr,
  ),
}
assert set(_SAMPLERS) == set(METHODS)


def _guided(denoise_fn, given, mask_id, scale):
  """Classifier-free guidance: (1 + w) log p(· | z) − w log p(· | z with the prompt masked),
  both from one call on the doubled batch. Entries the conditional rules out stay out."""

  def guided(z, alpha):
    batch_size = z.shape[0]
    both = denoise_fn(
      jnp.concatenate([z, jnp.where(given, mask_id, z)]),
      jnp.concatenate([jnp.broadcast_to(alpha, (batch_size,))] * 2),
    )
    cond, uncond = jnp.split(jax.nn.log_softmax(both.astype(jnp.float32), axis=-1), 2)
    floor = jnp.finfo(jnp.float32).min / 4  # Keeps (1 + w) cond − w uncond finite.
    mixed = (1.0 + scale) * cond - scale * jnp.maximum(uncond, floor)
    return jnp.where(jnp.isneginf(cond), -jnp.inf, mixed)

  return guided


def _run(setting: _Setting, key, prompt, prompt_mask):
  denoise_fn = bounds.checked_denoiser(setting.denoise_fn, setting.mask_id)
  z = _initial_tokens(setting.batch_size, setting.length, setting.mask_id, prompt, prompt_mask)
  if setting.guidance_scale != 0:
    denoise_fn = _guided(denoise_fn, z != setting.mask_id, setting.mask_id, setting.guidance_scale)
  trajectory = None
  if setting.record_trajectory:
    num_records = max_calls(setting.method, setting.length, setting.num_steps, setting.remask_loop)
    trajectory = _new_trajectory(z, num_records, setting.mask_id, setting.trajectory_top_k)
  if setting.schedule.state_dependent:
    tokens, nfe, first_bad, trajectory = _state_dependent_ancestral(
      key,
      denoise_fn,
      z,
      setting.schedule,
      setting.mask_id,
      setting.num_steps,
      setting.time_grid_kind,
      setting.probs,
      setting.noise,
      trajectory,
    )
  else:
    tokens, nfe, first_bad, trajectory = _SAMPLERS[setting.method](
      setting, key, denoise_fn, z, trajectory
    )
  info = {"nfe": nfe, "nonfinite_call": first_bad}
  if trajectory is not None:
    info["trajectory"] = trajectory
  return tokens, info


@functools.lru_cache(
  maxsize=16
)  # Bounded: each entry holds its denoiser (and what it closes over).
def _compiled(setting: _Setting):
  return jax.jit(functools.partial(_run, setting))


def check_logits(info: dict, method: str):
  """Raises NonFiniteLogitsError if a call's logits at a masked position were broken (host side)."""
  call = int(info["nonfinite_call"])
  if call >= 0:
    raise NonFiniteLogitsError(
      f"sampler {method!r}: network call {call + 1} of {int(info['nfe'])} returned logits with a "
      "NaN or +inf, or no finite value, at a masked position: no token can be drawn from them."
    )


def _check_prompt(prompt, prompt_mask, mask_id):
  """Given positions must hold clean ids (checked when the prompt is a concrete array)."""
  ids = np.asarray(prompt)
  given = ids != mask_id if prompt_mask is None else np.asarray(prompt_mask, bool)
  given = np.broadcast_to(given, np.broadcast_shapes(given.shape, ids.shape))
  ids = np.broadcast_to(ids, given.shape)
  if np.any((ids < 0) | (ids > mask_id)):
    raise ValueError(
      f"sample: prompt ids must be in [0, {mask_id}] (the mask id {mask_id} marks a "
      f"position to fill), got ids from {ids.min()} to {ids.max()}."
    )
  if np.any(given & (ids == mask_id)):
    raise ValueError(
      "sample: prompt_mask marks a position whose prompt id is the mask id; a given "
      "position must hold a clean token."
    )


def sample(
  key: Array,
  denoise_fn,
  *,
  batch_size: int,
  length: int,
  schedule,
  mask_id: int,
  method: str = "ancestral",
  num_steps: Optional[int] = None,
  temperature: float = 1.0,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
  prompt: Optional[Array] = None,
  prompt_mask: Optional[Array] = None,
  time_grid_kind: str = "uniform",
  confidence: str = "max_prob",
  threshold: Optional[float] = None,
  noise: str = "float64",
  remask: str = "cap",
  remask_eta: float = 0.0,
  remask_loop: int = 0,
  remask_loop_alpha: float = 0.9,
  guidance_scale: float = 0.0,
  record_trajectory: bool = False,
  trajectory_top_k: int = 5,
):
  """Generates [B, L] int32 tokens from all-mask (prompt positions given and clamped).

  Called with concrete arrays, it runs a compiled program cached by the denoiser (the same
  function object) and the settings, so a second call with them does not compile again, and
  it raises NonFiniteLogitsError if the denoiser returned broken logits. Called inside a
  caller's jit it traces inline; then check the returned info with `check_logits`.

  Args:
    prompt, prompt_mask: tokens [L] or [B, L] and where they are given (default:
      wherever prompt != mask_id); those positions never change (infilling
      when they are scattered).
    num_steps: steps of the time grid; ignored by first_hitting and threshold.
      Required otherwise.
    threshold: method="threshold" only: reveal every masked position whose top
      probability is >= threshold (in [0, 1]; 0 reveals everything in one call).
    noise: "float64" (accurate tails, default) or "float32" (for comparison only).
    remask, remask_eta, remask_loop, remask_loop_alpha: method="remdm" only: the strategy
      of σ_t ("cap": min(η, σ_max), "rescale": η σ_max, "confidence": σ_max shared by the
      visible tokens, the least confident first; η unused), and ReMDM-loop's extra steps at
      the fixed α the grid first reaches above remask_loop_alpha (then only they remask).
    guidance_scale: w of classifier-free guidance (any method): each call mixes the
      denoiser's log-probs as (1 + w) cond − w uncond, uncond with the prompt masked (one
      call on the doubled batch); 0 is the conditional model, bit for bit. Needs a prompt.
    record_trajectory: also return info["trajectory"]: "tokens" [S + 1, B, L]
      (the state before the first step and after each step), the denoiser's
      "top_ids" / "top_probs" [S, B, L, K] and "alphas" [S, B] at each step
      (the times t for a state-dependent schedule).
      S = max_calls(method, length, num_steps, remask_loop) (steps past info["nfe"] repeat
      the end).
  Returns:
    (tokens [B, L] int32, info): info["nfe"] the network calls for the batch (at most
    `max_calls(method, length, num_steps)`), info["nonfinite_call"] the index of the first
    call whose logits at a masked position were broken (−1: none).
  """
  if method not in METHODS:
    raise ValueError(f"Unknown sampling method {method!r}; valid: {', '.join(METHODS)}.")
  if schedule.state_dependent and method != "ancestral":
    raise ValueError(
      f"The state-dependent schedule {schedule.name!r} samples with "
      f"method='ancestral' only, got {method!r}."
    )
  if method not in ("first_hitting", "threshold") and (num_steps is None or num_steps < 1):
    raise ValueError(f"method={method!r} needs num_steps >= 1, got {num_steps!r}.")
  if (method == "threshold") != (threshold is not None) or (
    threshold is not None and not 0 <= threshold <= 1
  ):
    raise ValueError(
      "method='threshold' needs a threshold in [0, 1], and only it takes one; got "
      f"method={method!r}, threshold={threshold!r}."
    )
  if noise not in categorical.NOISE_KINDS:
    raise ValueError(f"Unknown noise {noise!r}; valid: {', '.join(categorical.NOISE_KINDS)}.")
  if time_grid_kind not in TIME_GRIDS:
    raise ValueError(f"Unknown time grid {time_grid_kind!r}; valid: {', '.join(TIME_GRIDS)}.")
  if confidence not in CONFIDENCES:
    raise ValueError(f"Unknown confidence {confidence!r}; valid: {', '.join(CONFIDENCES)}.")
  if guidance_scale != 0 and prompt is None:
    raise ValueError(
      "sample: guidance_scale needs a prompt: guidance contrasts the prompt with the prompt masked."
    )
  if not guidance_scale >= 0:
    raise ValueError(f"sample: guidance_scale must be >= 0, got {guidance_scale}.")
  if remask not in REMASKS:
    raise ValueError(f"Unknown remask strategy {remask!r}; valid: {', '.join(REMASKS)}.")
  if not 0 <= remask_eta <= 1 or remask_loop < 0 or not 0 < remask_loop_alpha < 1:
    raise ValueError(
      "remdm needs 0 <= remask_eta <= 1, remask_loop >= 0 and 0 < remask_loop_alpha "
      f"< 1; got {remask_eta}, {remask_loop}, {remask_loop_alpha}."
    )
  categorical.filter_logits(jnp.zeros((1, 2)), temperature=temperature, top_k=top_k, top_p=top_p)
  for name, given in (("prompt", prompt), ("prompt_mask", prompt_mask)):
    if given is not None:
      chex.assert_rank(given, {1, 2}, custom_message=f"sample: {name} must be [L] or [B, L]")
      chex.assert_shape(
        given,
        (batch_size, length)[-jnp.ndim(given) :],
        custom_message=f"sample: {name} must be [length] or [batch_size, length]",
      )
  setting = _Setting(
    denoise_fn,
    batch_size,
    length,
    schedule,
    mask_id,
    method,
    num_steps,
    temperature,
    top_k,
    top_p,
    time_grid_kind,
    confidence,
    threshold,
    noise,
    record_trajectory,
    trajectory_top_k,
    remask,
    float(remask_eta),
    int(remask_loop),
    float(remask_loop_alpha),
    float(guidance_scale),
  )
  traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((key, prompt, prompt_mask)))
  if traced:
    return _run(setting, key, prompt, prompt_mask)
  if prompt is not None:
    _check_prompt(prompt, prompt_mask, mask_id)
  try:
    run = _compiled(setting)
  except TypeError:  # An unhashable schedule: compile for this call only.
    run = jax.jit(functools.partial(_run, setting))
  tokens, info = run(key, prompt, prompt_mask)
  check_logits(info, method)
  return tokens, info
