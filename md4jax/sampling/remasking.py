"""ReMDM (Wang et al. 2025): the sampler whose steps may mask a visible token again."""

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking
from md4jax.sampling import steps

REMASKS = ("cap", "rescale", "confidence")  # ReMDM's σ_t strategies.


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


def sample_remdm(
  key,
  call,
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
  previous,
):
  """ReMDM (Wang et al. 2025): ancestral steps in which visible tokens may be masked again.

  From t to s a visible token is masked with prob σ_t and a masked one revealed with prob
  (α_s − (1 − σ_t) α_t) / (1 − α_t), which keeps the forward marginals; σ_t = 0 is ancestral,
  token for token (the same keys). `key` is one key per row [B]. With loop_steps > 0 (ReMDM-loop), the grid's steps do not
  remask; after the first step that reaches α ≥ loop_alpha, loop_steps more steps run at that
  fixed α, each remasking with the strategy's σ. Prompt positions are never masked.
  """
  grid = steps.time_grid(num_steps, grid_kind)
  mask_grid = schedule.mask_prob(grid)
  batch_size = z.shape[0]
  editable = z == mask_id
  # The grid step after which the loop runs: the first (from t = 1) whose s has α ≥ loop_alpha,
  # and at the latest the one before the last step (the last reveals everything).
  reached = (1.0 - mask_grid[:-1]) >= loop_alpha  # [T]: α(t_{k−1}) ≥ loop_alpha, k = 1..T.
  loop_after = jnp.maximum(jnp.max(jnp.where(reached, jnp.arange(1, num_steps + 1), 0)), 2)
  loop_start = num_steps - loop_after + 1  # Iterations before the loop.

  def body(i, carry):
    z, confidence, first_bad, trajectory, previous = carry
    in_loop = (loop_steps > 0) & (i >= loop_start) & (i < loop_start + loop_steps)
    after_loop = (loop_steps > 0) & (i >= loop_start + loop_steps)
    step = jnp.where(after_loop, num_steps - (i - loop_steps), num_steps - i)
    step = jnp.where(in_loop, loop_after - 1, step)  # Held at α(t_{k*−1}).
    # Per-row keys [B]; a loop step's keys lie past the grid's, so they never repeat one.
    step_key = steps.fold_in(key, jnp.where(in_loop, num_steps + 1 + i, step))
    reveal_key, draw_key = masking.split_keys(step_key, 2)
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
    base = jnp.where(in_loop, 0.0, steps.reveal_probability(schedule, grid, step))
    reveal_prob = jnp.where(
      (step == 1) & ~in_loop, 1.0, base + masked_sigma * alpha_t / jnp.maximum(mask_t, 1e-30)
    )
    reveal = masked & (masking.uniform(reveal_key, z.shape) < reveal_prob)
    remask = visible & (masking.uniform(steps.fold_in(step_key, 2), z.shape) < sigma)
    alpha = steps.alphas(schedule, grid[step], batch_size)
    logits, previous = call(z, alpha, previous)
    first_bad = steps.first_bad_call(first_bad, i, steps.nonfinite_rows(logits, z, mask_id))
    drawn = draw(draw_key, logits)
    drawn_prob = jnp.take_along_axis(probs(logits), drawn[..., None], axis=-1)[..., 0]
    z = jnp.where(reveal, drawn, jnp.where(remask, mask_id, z))
    confidence = jnp.where(reveal, -drawn_prob, jnp.where(remask, -jnp.inf, confidence))
    trajectory = steps.record(trajectory, i, z, logits, alpha)
    return z, confidence, first_bad, trajectory, previous

  total = num_steps + loop_steps
  init = (z, jnp.full(z.shape, -jnp.inf, jnp.float32), jnp.int32(-1), trajectory, previous)
  z, _, first_bad, trajectory, _ = jax.lax.fori_loop(0, total, body, init)
  return z, jnp.int32(total), first_bad, trajectory
