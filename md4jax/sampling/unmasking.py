"""The samplers that only reveal: a visible token is never masked again (docs/math.md, "Reverse
process"). ancestral and cached step through a time grid, jump skips the grid's steps that
reveal nothing, first_hitting draws each reveal's time exactly, and confidence and threshold
reveal the positions the denoiser is surest of; `md4jax.sampling.samplers` describes each.

Each takes one key per row [B] (`masking.row_keys`; row b draws from keys[b] alone), the denoiser,
the initial tokens z [B, L] and the trajectory (or None), and returns (tokens, calls, first broken
call or −1, trajectory).
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion import masking
from md4jax.sampling import categorical, steps

# How confidence ranks a masked position: by its law after temperature / top-k / top-p (the top
# probability, the top two's margin, minus the entropy), or by the token drawn there: its plain
# softmax probability (LLaDA's low_confidence) or its probability under that law (Dream's
# maskgit_plus).
CONFIDENCES = ("max_prob", "margin", "neg_entropy", "drawn_prob", "drawn_filtered_prob")
# How many masked positions each step of method "confidence" reveals (`reveal_count`).
REVEAL_COUNTS = ("schedule", "even", "proportional")
DREAM_EPS = 1e-3  # Dream's last time, timesteps = linspace(1, eps, T + 1).


def sample_ancestral(
  key, call, z, schedule, mask_id, num_steps, grid_kind, cached, draw, trajectory, previous
):
  grid = steps.time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, logits, cache_valid, nfe, first_bad, trajectory, previous = carry
    step = num_steps - i  # From T down to 1.
    reveal_key, draw_key = masking.split_keys(steps.fold_in(key, step), 2)
    reveal = (z == mask_id) & (
      masking.uniform(reveal_key, z.shape) < steps.reveal_probability(schedule, grid, step)
    )
    any_reveal = reveal.any()
    need_call = ~cache_valid & any_reveal if cached else jnp.bool_(True)
    alpha = steps.alphas(schedule, grid[step], batch_size)
    logits, previous = jax.lax.cond(
      need_call, lambda: call(z, alpha, previous), lambda: (logits, previous)
    )
    first_bad = steps.first_bad_call(
      first_bad, nfe, need_call & steps.nonfinite_rows(logits, z, mask_id)
    )
    z = jnp.where(reveal, draw(draw_key, logits), z)
    cache_valid = (cache_valid | need_call) & ~any_reveal
    trajectory = steps.record(trajectory, i, z, logits, alpha)
    nfe = nfe + need_call.astype(jnp.int32)
    return z, logits, cache_valid, nfe, first_bad, trajectory, previous

  logits = jnp.zeros(z.shape + (mask_id,), jnp.float32)
  init = (z, logits, jnp.bool_(False), jnp.int32(0), jnp.int32(-1), trajectory, previous)
  z, _, _, nfe, first_bad, trajectory, _ = jax.lax.fori_loop(0, num_steps, body, init)
  return z, nfe, first_bad, trajectory


def sample_state_dependent(
  key, denoise_fn, z, schedule, mask_id, num_steps, grid_kind, filtered, noise, trajectory
):
  """Ancestral steps under a state-dependent schedule (GenMD4); denoise_fn(z, t [B]).

  From t to s, a masked position whose clean value is v stays masked with prob
  (1 − α_v(s)) / (1 − α_v(t)) (the forward process, read backwards), so given the prediction μ
  it is revealed as v with prob μ_v (α_v(s) − α_v(t)) / (1 − α_v(t)) and stays masked with prob
  Σ_v μ_v (1 − α_v(s)) / (1 − α_v(t)): one categorical over V + 1 outcomes, the last of which
  (id V = mask_id) is "stay masked". μ is the denoiser's law after temperature / top-k / top-p.
  """
  grid = steps.time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]

  def body(i, carry):
    z, first_bad, trajectory = carry
    step = num_steps - i
    time = jnp.full((batch_size,), grid[step], jnp.float32)
    logits = denoise_fn(z, time).astype(jnp.float32)
    first_bad = steps.first_bad_call(first_bad, i, steps.nonfinite_rows(logits, z, mask_id))
    mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
    # P(still masked at s | masked at t, value v) [V]; 0 on the last step (α_v(0) = 1).
    stay = jnp.where((step > 1) & (mask_t > 0), mask_s / jnp.where(mask_t > 0, mask_t, 1.0), 0.0)
    probs = filtered(logits)
    outcome_probs = jnp.concatenate(
      [probs * (1.0 - stay), jnp.sum(probs * stay, axis=-1, keepdims=True)], axis=-1
    )
    outcome_logits = jnp.log(jnp.maximum(outcome_probs, 0.0))
    outcome = categorical.sample_categorical(steps.fold_in(key, step), outcome_logits, noise=noise)
    z = jnp.where(z == mask_id, outcome, z)  # Outcome mask_id: stays masked.
    return z, first_bad, steps.record(trajectory, i, z, logits, time)

  z, first_bad, trajectory = jax.lax.fori_loop(0, num_steps, body, (z, jnp.int32(-1), trajectory))
  return z, jnp.int32(num_steps), first_bad, trajectory


def _reveal_at_least_one(key, masked, reveal_prob):
  """Each masked position revealed with prob r, conditioned on at least one, [B, L] bool. Exact:
  in a uniformly random order, the first revealed one is at K ~ Geometric(r) truncated to 1..n
  (drawn by inverse CDF, in logs), and every later one is revealed with prob r on its own."""
  order_key, first_key, rest_key = masking.split_keys(key, 3)
  n = masked.sum(-1)
  scores = jnp.where(masked, masking.uniform(order_key, masked.shape), -1.0)
  rank = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)  # 0..n−1 over the masked positions.
  log_keep = jnp.log1p(-jnp.minimum(reveal_prob, 1.0))[:, None]  # log(1 − r); −inf when r = 1.
  u = masking.uniform(first_key, n.shape)[:, None]
  all_kept = -jnp.expm1(n[:, None] * log_keep)  # 1 − (1 − r)^n
  first = jnp.ceil(jnp.log1p(-u * all_kept) / log_keep) - 1  # 0-based rank of the first reveal.
  first = jnp.clip(jnp.nan_to_num(first, nan=0.0), 0, jnp.maximum(n[:, None] - 1, 0))
  later = masking.uniform(rest_key, masked.shape) < reveal_prob[:, None]
  return masked & ((rank == first) | ((rank > first) & later))


def sample_jump(key, call, z, schedule, mask_id, num_steps, grid_kind, draw, trajectory, previous):
  grid = steps.time_grid(num_steps, grid_kind)
  mask_grid = schedule.mask_prob(grid)  # λ(t_0) ≤ ... ≤ λ(t_T), [T + 1].
  batch_size, length = z.shape
  max_calls = min(num_steps, length)  # Each call moves every unfinished row ≥ 1 step, ≥ 1 reveal.

  def cond(carry):
    return (carry[2] < max_calls) & (carry[0] == mask_id).any()

  def body(carry):
    # step [B]: the next grid step each row processes.
    z, step, nfe, first_bad, trajectory, previous = carry
    hit_key, reveal_key, draw_key = masking.split_keys(steps.fold_in(key, nfe), 3)
    masked = z == mask_id
    n = masked.sum(-1)
    u = masking.uniform(hit_key, (batch_size,), minval=1e-12)
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
    logits, previous = call(z, alpha, previous)
    first_bad = steps.first_bad_call(first_bad, nfe, steps.nonfinite_rows(logits, z, mask_id))
    z = jnp.where(reveal, draw(draw_key, logits), z)
    step = jnp.where(n > 0, event - 1, step)
    trajectory = steps.record(trajectory, nfe, z, logits, alpha)
    return z, step, nfe + 1, first_bad, trajectory, previous

  steps_left = jnp.full((batch_size,), num_steps, jnp.int32)
  init = (z, steps_left, jnp.int32(0), jnp.int32(-1), trajectory, previous)
  z, _, nfe, first_bad, trajectory, _ = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, steps.repeat_final(trajectory, z, nfe)


def sample_threshold(key, call, z, mask_id, threshold, draw, filtered, trajectory, previous):
  length = z.shape[1]

  def cond(carry):  # Each call reveals ≥ 1 position of every unfinished row: ≤ L calls.
    return (carry[1] < length) & (carry[0] == mask_id).any()

  def body(carry):
    z, nfe, first_bad, trajectory, previous = carry
    masked = z == mask_id
    alpha = 1.0 - masked.sum(-1) / length  # The share already revealed.
    logits, previous = call(z, alpha, previous)
    first_bad = steps.first_bad_call(first_bad, nfe, steps.nonfinite_rows(logits, z, mask_id))
    top = steps.masked_scores(jax.nn.softmax(filtered(logits), axis=-1).max(-1), masked)
    # The most confident masked position: argmax over top, where a broken (NaN) score of a
    # masked position still beats every visible one (a visible "best" would reveal nothing).
    best = jax.nn.one_hot(jnp.argmax(top, -1), length, dtype=jnp.bool_)
    reveal = masked & ((top >= threshold) | best)
    z = jnp.where(reveal, draw(steps.fold_in(key, nfe), logits), z)
    return z, nfe + 1, first_bad, steps.record(trajectory, nfe, z, logits, alpha), previous

  init = (z, jnp.int32(0), jnp.int32(-1), trajectory, previous)
  z, nfe, first_bad, trajectory, _ = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, steps.repeat_final(trajectory, z, nfe)


def sample_first_hitting(key, call, z, mask_id, draw, trajectory, previous):
  batch_size, length = z.shape

  def cond(carry):  # One reveal per unfinished row and call: ≤ L calls.
    return (carry[2] < length) & (carry[0] == mask_id).any()

  def body(carry):
    z, mask_rate, nfe, first_bad, trajectory, previous = carry
    time_key, position_key, draw_key = masking.split_keys(steps.fold_in(key, nfe), 3)
    masked = z == mask_id
    num_masked = masked.sum(-1)
    u = masking.uniform(time_key, (batch_size,), minval=1e-12)  # Avoid λ = 0 exactly.
    mask_rate = jnp.where(
      num_masked > 0, mask_rate * u ** (1.0 / jnp.maximum(num_masked, 1)), mask_rate
    )
    # The denoiser sees z just above the hitting time, with α at that time.
    alpha = 1.0 - mask_rate
    logits, previous = call(z, alpha, previous)
    first_bad = steps.first_bad_call(first_bad, nfe, steps.nonfinite_rows(logits, z, mask_id))
    scores = jnp.where(masked, masking.uniform(position_key, z.shape), -1.0)
    position = jax.nn.one_hot(jnp.argmax(scores, -1), length, dtype=jnp.bool_) & masked
    z = jnp.where(position, draw(draw_key, logits), z)
    trajectory = steps.record(trajectory, nfe, z, logits, alpha)
    return z, mask_rate, nfe + 1, first_bad, trajectory, previous

  mask_rate = jnp.ones((batch_size,), jnp.float32)
  init = (z, mask_rate, jnp.int32(0), jnp.int32(-1), trajectory, previous)
  z, _, nfe, first_bad, trajectory, _ = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, steps.repeat_final(trajectory, z, nfe)


def _confidence_scores(kind, logits, filtered, drawn):
  """[B, L] scores of `kind` (CONFIDENCES) from the logits, the filter of their law and the tokens
  drawn from it."""
  if kind == "drawn_prob":
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    probs = jax.nn.softmax(filtered(logits), axis=-1)
  if kind in ("drawn_prob", "drawn_filtered_prob"):
    return jnp.take_along_axis(probs, drawn[..., None], axis=-1)[..., 0]
  if kind == "max_prob":
    return probs.max(-1)
  if kind == "margin":
    top2 = jax.lax.top_k(probs, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if kind == "neg_entropy":
    return jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0), -1)
  raise ValueError(f"Unknown confidence {kind!r}; valid: {', '.join(CONFIDENCES)}.")


def _round_to_float32(x: Fraction) -> np.float32:
  """The exact value x rounded once to float32 (to nearest, ties to even), as an FMA does."""
  near = np.float32(float(x))  # Rounded twice: at most one float32 step off.
  candidates = [
    np.nextafter(near, np.float32(-np.inf)),
    near,
    np.nextafter(near, np.float32(np.inf)),
  ]
  return min(candidates, key=lambda c: (abs(Fraction(float(c)) - x), int(c.view(np.int32)) & 1))


def torch_linspace_float32(start: float, end: float, num: int) -> np.ndarray:
  """torch.linspace(start, end, num) in float32, bit for bit: step = (end − start) / (num − 1),
  the first num // 2 values start + i·step, the others end − (num − 1 − i)·step, each rounded once
  (the kernel's multiply-add is fused; checked against torch 2.13's CPU kernel)."""
  start, end = np.float32(start), np.float32(end)
  if num == 1:
    return np.asarray([start], np.float32)
  step = np.float32(end - start) / np.float32(num - 1)
  values = [
    _round_to_float32(Fraction(float(start)) + Fraction(float(step)) * i)
    if i < num // 2
    else _round_to_float32(Fraction(float(end)) - Fraction(float(step)) * (num - 1 - i))
    for i in range(num)
  ]
  return np.asarray(values, np.float32)


def proportional_factors(num_steps: int) -> np.ndarray:
  """Dream's share of the masked positions each step reveals, [T] float32: 1 − s / t for
  timesteps = linspace(1, 1e-3, T + 1), t = timesteps[i], s = timesteps[i + 1], in float32."""
  times = torch_linspace_float32(1.0, DREAM_EPS, num_steps + 1)
  return np.float32(1.0) - times[1:] / times[:-1]


def reveal_count(rule, i, num_steps, masked, initial, *, schedule=None, grid=None, factors=None):
  """[B] positions step i (0-based, of T) reveals, for `masked` [B] masks now and `initial` [B]
  at the start of the block:

    "schedule"      all but floor(initial · λ(t_{i+1}) / λ(t_0)) (the schedule's share of the
                    initial masks stays masked), at least one; all that are left at the end.
    "even"          LLaDA's get_num_transfer_tokens: initial // T, plus one on the first
                    initial % T steps (0 on the last steps when initial < T).
    "proportional"  Dream's: int(float32(masked) · factors[i]) (`proportional_factors`), all
                    that are left at the last step.
  """
  if rule == "schedule":
    step = num_steps - i
    share = schedule.mask_prob(grid[step - 1]) / schedule.mask_prob(grid[num_steps])
    keep = jnp.where(step == 1, 0, jnp.floor(initial * share).astype(jnp.int32))
    return jnp.maximum(masked - keep, jnp.minimum(masked, 1))
  if rule == "even":
    return initial // num_steps + (i < initial % num_steps).astype(initial.dtype)
  if rule == "proportional":
    share = jnp.asarray(factors, jnp.float32)[i]
    part = (masked.astype(jnp.float32) * share).astype(masked.dtype)  # Truncates, as int() does.
    return jnp.where(i == num_steps - 1, masked, part)
  raise ValueError(f"Unknown reveal_counts {rule!r}; valid: {', '.join(REVEAL_COUNTS)}.")


def sample_confidence(
  key,
  call,
  z,
  schedule,
  mask_id,
  num_steps,
  grid_kind,
  draw,
  filtered,
  confidence,
  trajectory,
  reveal_counts,
  previous,
):
  grid = steps.time_grid(num_steps, grid_kind)
  batch_size = z.shape[0]
  initial_masked = (z == mask_id).sum(-1)
  factors = proportional_factors(num_steps) if reveal_counts == "proportional" else None

  # Once nothing is masked the steps left would change nothing, and are not run: with the
  # schedule's at-least-one rule or LLaDA's even counts that is after at most min(T, L) steps;
  # Dream's proportional counts keep a mask until the last step, so each of its T steps is a call.
  def cond(carry):
    i, z = carry[:2]
    return (i < num_steps) & (z == mask_id).any()

  def body(carry):
    i, z, first_bad, trajectory, previous = carry
    step = num_steps - i
    masked = z == mask_id
    alpha = steps.alphas(schedule, grid[step], batch_size)
    logits, previous = call(z, alpha, previous)
    first_bad = steps.first_bad_call(first_bad, i, steps.nonfinite_rows(logits, z, mask_id))
    num_reveal = reveal_count(
      reveal_counts,
      i,
      num_steps,
      masked.sum(-1),
      initial_masked,
      schedule=schedule,
      grid=grid,
      factors=factors,
    )
    drawn = draw(steps.fold_in(key, step), logits)
    # Masked positions rank first whatever their scores (NaN ones last among them), so the
    # step reveals num_reveal masked positions and the last step all that are left. Equal
    # scores rank the lower position first (a stable sort).
    scores = _confidence_scores(confidence, logits, filtered, drawn)
    scores = steps.masked_scores(scores, masked)
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1, stable=True), axis=-1, stable=True)
    reveal = masked & (rank < num_reveal[:, None])
    z = jnp.where(reveal, drawn, z)
    return i + 1, z, first_bad, steps.record(trajectory, i, z, logits, alpha), previous

  init = (jnp.int32(0), z, jnp.int32(-1), trajectory, previous)
  nfe, z, first_bad, trajectory, _ = jax.lax.while_loop(cond, body, init)
  return z, nfe, first_bad, steps.repeat_final(trajectory, z, nfe)
