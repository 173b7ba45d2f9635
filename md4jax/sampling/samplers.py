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

A state-dependent schedule (GenMD4) samples with "ancestral" only, and its
denoiser is called as denoise_fn(z, t [B]). From t to s, a masked position
whose clean value is v stays masked with prob (1 − α_v(s)) / (1 − α_v(t))
(the forward process, read backwards), so given the prediction μ it is
revealed as v with prob μ_v (α_v(s) − α_v(t)) / (1 − α_v(t)) and stays masked
with prob Σ_v μ_v (1 − α_v(s)) / (1 − α_v(t)): one categorical over V + 1
outcomes, the last of which (id V = mask_id) is "stay masked". μ is the
denoiser's law after temperature / top-k / top-p.
"""

import functools
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from md4jax.diffusion import bounds
from md4jax.sampling import categorical

Array = jax.Array

METHODS = ("ancestral", "cached", "jump", "first_hitting", "confidence", "threshold")
TIME_FREE_METHODS = ("cached", "jump")  # Exact only for a denoiser that ignores α.
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


def _state_dependent_ancestral(key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind,
                               filtered, noise, trajectory):
  grid = time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, trajectory = carry
    step = num_steps - i
    time = jnp.full((batch_size,), grid[step], jnp.float32)
    logits = denoise_fn(z, time).astype(jnp.float32)
    mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
    # P(still masked at s | masked at t, value v) [V]; 0 on the last step (α_v(0) = 1).
    stay = jnp.where((step > 1) & (mask_t > 0), mask_s / jnp.where(mask_t > 0, mask_t, 1.0), 0.0)
    probs = filtered(logits)
    outcome_probs = jnp.concatenate(
        [probs * (1.0 - stay), jnp.sum(probs * stay, axis=-1, keepdims=True)], axis=-1)
    outcome_logits = jnp.log(jnp.maximum(outcome_probs, 0.0))
    outcome = categorical.sample_categorical(jax.random.fold_in(key, step), outcome_logits,
                                             noise=noise)
    z = jnp.where(z == mask_id, outcome, z)  # Outcome mask_id: stays masked.
    return z, _record(trajectory, i, z, logits, time)

  z, trajectory = jax.lax.fori_loop(0, num_steps, body, (z, trajectory))
  return z, jnp.int32(num_steps), trajectory


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
  batch_size = z.shape[0]

  def cond(carry):
    return (carry[0] == mask_id).any()

  def body(carry):
    z, step, nfe, trajectory = carry  # step [B]: the next grid step each sequence processes.
    hit_key, reveal_key, draw_key = jax.random.split(jax.random.fold_in(key, nfe), 3)
    masked = z == mask_id
    n = masked.sum(-1)
    u = jax.random.uniform(hit_key, (batch_size,), minval=1e-12)
    # Steps step..k reveal nothing with prob (λ(t_{k−1}) / λ(t_step))^n: the event step j has
    # λ(t_{j−1}) < λ(t_step) u^(1/n) ≤ λ(t_j) (the last step, j = 1, reveals all that is left).
    target = mask_grid[step] * u ** (1.0 / jnp.maximum(n, 1))
    # Finished rows (step 0) keep event 1: nothing of theirs is masked, nothing changes.
    event = jnp.clip(jnp.searchsorted(mask_grid, target, side="left"), 1, jnp.maximum(step, 1))
    reveal_prob = jnp.where(event == 1, 1.0, (mask_grid[event] - mask_grid[event - 1])
                            / jnp.maximum(mask_grid[event], 1e-30))
    reveal = _reveal_at_least_one(reveal_key, masked, reveal_prob)
    alpha = schedule.alpha(grid[event]).astype(jnp.float32)
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    z = jnp.where(reveal, draw(draw_key, logits), z)
    step = jnp.where(n > 0, event - 1, step)
    return z, step, nfe + 1, _record(trajectory, nfe, z, logits, alpha)

  init = (z, jnp.full((batch_size,), num_steps, jnp.int32), jnp.int32(0), trajectory)
  z, _, nfe, trajectory = jax.lax.while_loop(cond, body, init)
  return z, nfe, _repeat_final(trajectory, z, nfe)


def _repeat_final(trajectory, z, nfe):
  """Recorded steps past the last call repeat the final state."""
  if trajectory is not None:
    after_end = jnp.arange(trajectory["tokens"].shape[0])[:, None, None] > nfe
    trajectory["tokens"] = jnp.where(after_end, z, trajectory["tokens"])
  return trajectory


def _threshold(key, denoise_fn, z, mask_id, threshold, draw, filtered, trajectory):
  length = z.shape[1]

  def cond(carry):
    return (carry[0] == mask_id).any()

  def body(carry):
    z, nfe, trajectory = carry
    masked = z == mask_id
    alpha = 1.0 - masked.sum(-1) / length  # The share already revealed.
    logits = denoise_fn(z, alpha).astype(jnp.float32)
    top = jnp.where(masked, jax.nn.softmax(filtered(logits), axis=-1).max(-1), -1.0)
    best = jax.nn.one_hot(jnp.argmax(top, -1), length, dtype=jnp.bool_)
    reveal = masked & ((top >= threshold) | best)
    z = jnp.where(reveal, draw(jax.random.fold_in(key, nfe), logits), z)
    return z, nfe + 1, _record(trajectory, nfe, z, logits, alpha)

  z, nfe, trajectory = jax.lax.while_loop(cond, body, (z, jnp.int32(0), trajectory))
  return z, nfe, _repeat_final(trajectory, z, nfe)


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
  return z, nfe, _repeat_final(trajectory, z, nfe)


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

  # Each step reveals at least one mask per sequence, so with T > L the batch is done before
  # step T; the steps after that would change nothing, and are not run.
  def cond(carry):
    i, z, _ = carry
    return (i < num_steps) & (z == mask_id).any()

  def body(carry):
    i, z, trajectory = carry
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
    return i + 1, z, _record(trajectory, i, z, logits, alpha)

  nfe, z, trajectory = jax.lax.while_loop(cond, body, (jnp.int32(0), z, trajectory))
  return z, nfe, _repeat_final(trajectory, z, nfe)


def sample(key: Array, denoise_fn, *, batch_size: int, length: int, schedule, mask_id: int,
           method: str = "ancestral", num_steps: Optional[int] = None, temperature: float = 1.0,
           top_k: Optional[int] = None, top_p: Optional[float] = None,
           prompt: Optional[Array] = None, prompt_mask: Optional[Array] = None,
           time_grid_kind: str = "uniform", confidence: str = "max_prob",
           threshold: Optional[float] = None, noise: str = "float64",
           record_trajectory: bool = False, trajectory_top_k: int = 5):
  """Generates [B, L] int32 tokens from all-mask (prompt positions given and clamped).

  Args:
    prompt, prompt_mask: tokens [L] or [B, L] and where they are given (default:
      wherever prompt != mask_id); those positions never change (infilling
      when they are scattered).
    num_steps: steps of the time grid; ignored by first_hitting and threshold.
      Required otherwise.
    threshold: method="threshold" only: reveal every masked position whose top
      probability is >= threshold (in (0, 1]).
    noise: "float64" (accurate tails, default) or "float32" (for comparison only).
    record_trajectory: also return info["trajectory"]: "tokens" [S + 1, B, L]
      (the state before the first step and after each step), the denoiser's
      "top_ids" / "top_probs" [S, B, L, K] and "alphas" [S, B] at each step
      (the times t for a state-dependent schedule).
      S = num_steps; L for first_hitting and threshold; min(num_steps, L) for jump
      (steps past info["nfe"] repeat the end).
  Returns:
    (tokens [B, L] int32, info) with info["nfe"] the number of network calls for the batch.
  """
  if method not in METHODS:
    raise ValueError(f"Unknown sampling method {method!r}; valid: {', '.join(METHODS)}.")
  if schedule.state_dependent and method != "ancestral":
    raise ValueError(f"The state-dependent schedule {schedule.name!r} samples with "
                     f"method='ancestral' only, got {method!r}.")
  if method not in ("first_hitting", "threshold") and (num_steps is None or num_steps < 1):
    raise ValueError(f"method={method!r} needs num_steps >= 1, got {num_steps!r}.")
  if (method == "threshold") != (threshold is not None) or (
      threshold is not None and not 0 < threshold <= 1):
    raise ValueError("method='threshold' needs a threshold in (0, 1], and only it takes one; got "
                     f"method={method!r}, threshold={threshold!r}.")
  if noise not in categorical.NOISE_KINDS:
    raise ValueError(f"Unknown noise {noise!r}; valid: {', '.join(categorical.NOISE_KINDS)}.")
  filter_kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  categorical.filter_logits(jnp.zeros((1, 2)), **filter_kwargs)  # Validates the arguments early.
  for name, given in (("prompt", prompt), ("prompt_mask", prompt_mask)):
    if given is not None:
      chex.assert_rank(given, {1, 2}, custom_message=f"sample: {name} must be [L] or [B, L]")
      chex.assert_shape(given, (batch_size, length)[-jnp.ndim(given):],
                        custom_message=f"sample: {name} must be [length] or [batch_size, length]")
  denoise_fn = bounds.checked_denoiser(denoise_fn, mask_id)

  def draw(draw_key, logits):
    return categorical.sample_categorical(draw_key, logits, noise=noise, **filter_kwargs)

  z = _initial_tokens(batch_size, length, mask_id, prompt, prompt_mask)
  trajectory = None
  if record_trajectory:
    num_records = {"first_hitting": length, "threshold": length,
                   "jump": min(num_steps or 1, length)}.get(method, num_steps)
    trajectory = _new_trajectory(z, num_records, mask_id, trajectory_top_k)
  if schedule.state_dependent:
    def probs(logits):
      if temperature == 0:  # Greedy: all mass on the top token.
        return jax.nn.one_hot(jnp.argmax(logits, -1), mask_id, dtype=jnp.float32)
      return jax.nn.softmax(categorical.filter_logits(logits, **filter_kwargs), axis=-1)
    tokens, nfe, trajectory = _state_dependent_ancestral(key, denoise_fn, z, schedule, mask_id,
                                                         num_steps, time_grid_kind, probs, noise,
                                                         trajectory)
  elif method in ("ancestral", "cached"):
    tokens, nfe, trajectory = _ancestral(key, denoise_fn, z, schedule, mask_id, num_steps,
                                         time_grid_kind, method == "cached", draw, trajectory)
  elif method == "jump":
    tokens, nfe, trajectory = _jump(key, denoise_fn, z, schedule, mask_id, num_steps,
                                    time_grid_kind, draw, trajectory)
  elif method == "first_hitting":
    tokens, nfe, trajectory = _first_hitting(key, denoise_fn, z, mask_id, draw, trajectory)
  elif method == "threshold":
    tokens, nfe, trajectory = _threshold(key, denoise_fn, z, mask_id, threshold, draw,
                                         functools.partial(categorical.filter_logits, **filter_kwargs),
                                         trajectory)
  else:
    def filtered(logits):
      return categorical.filter_logits(logits, **filter_kwargs)
    tokens, nfe, trajectory = _confidence(key, denoise_fn, z, schedule, mask_id, num_steps,
                                          time_grid_kind, draw, filtered, confidence, trajectory)
  info = {"nfe": nfe}
  if trajectory is not None:
    info["trajectory"] = trajectory
  return tokens, info
