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

Methods (in `unmasking`, which only reveals, and `remasking`; their shared steps in `steps`):
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
denoiser is called as denoise_fn(z, t [B]) (`unmasking.sample_state_dependent`).
"""

import dataclasses
import functools
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion import bounds
from md4jax.sampling import categorical, remasking, steps, unmasking

# The samplers' names and helpers, re-exported: callers (and md4jax's front door) know them as
# samplers.max_calls etc.
from md4jax.sampling.remasking import REMASKS
from md4jax.sampling.steps import (
  TIME_GRIDS,
  NonFiniteLogitsError,
  check_logits,
  max_calls,
  time_grid,
)
from md4jax.sampling.unmasking import CONFIDENCES

__all__ = [
  "CONFIDENCES",
  "METHODS",
  "NonFiniteLogitsError",
  "REMASKS",
  "TIME_FREE_METHODS",
  "TIME_GRIDS",
  "check_logits",
  "max_calls",
  "sample",
  "time_grid",
]

Array = jax.Array

METHODS = ("ancestral", "cached", "jump", "first_hitting", "confidence", "threshold", "remdm")
TIME_FREE_METHODS = ("cached", "jump")  # Exact only for a denoiser that ignores α.


def _initial_tokens(batch_size, length, mask_id, prompt, prompt_mask) -> Array:
  z = jnp.full((batch_size, length), mask_id, jnp.int32)
  if prompt is None:
    return z
  prompt = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (batch_size, length))
  given = prompt != mask_id  # A position holding the mask id is filled, whatever prompt_mask says.
  if prompt_mask is not None:
    given &= jnp.broadcast_to(jnp.asarray(prompt_mask, jnp.bool_), (batch_size, length))
  return jnp.where(given, prompt, z)


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
  "ancestral": lambda s, key, f, z, tr: unmasking.sample_ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, False, s.draw, tr
  ),
  "cached": lambda s, key, f, z, tr: unmasking.sample_ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, True, s.draw, tr
  ),
  "jump": lambda s, key, f, z, tr: unmasking.sample_jump(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, s.draw, tr
  ),
  "first_hitting": lambda s, key, f, z, tr: unmasking.sample_first_hitting(
    key, f, z, s.mask_id, s.draw, tr
  ),
  "confidence": lambda s, key, f, z, tr: unmasking.sample_confidence(
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
  "threshold": lambda s, key, f, z, tr: unmasking.sample_threshold(
    key, f, z, s.mask_id, s.threshold, s.draw, s.filtered, tr
  ),
  "remdm": lambda s, key, f, z, tr: remasking.sample_remdm(
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


def with_prompt_masked(z, alpha, given, mask_id):
  """Guidance's doubled batch: (z then z with the given positions masked, alpha twice) [2B]."""
  batch_size = z.shape[0]
  alpha = jnp.broadcast_to(alpha, (batch_size,))
  return jnp.concatenate([z, jnp.where(given, mask_id, z)]), jnp.concatenate([alpha, alpha])


def mix_guidance(both, scale):
  """Classifier-free guidance from one call's logits on the doubled batch [conditional;
  prompt masked]: (1 + w) log p(· | z) − w log p(· | z with the prompt masked). Entries the
  conditional rules out stay out."""
  cond, uncond = jnp.split(jax.nn.log_softmax(both.astype(jnp.float32), axis=-1), 2)
  floor = jnp.finfo(jnp.float32).min / 4  # Keeps (1 + w) cond − w uncond finite.
  mixed = (1.0 + scale) * cond - scale * jnp.maximum(uncond, floor)
  return jnp.where(jnp.isneginf(cond), -jnp.inf, mixed)


def _guided(denoise_fn, given, mask_id, scale):
  """denoise_fn under classifier-free guidance: both logits from one call on the doubled batch."""

  def guided(z, alpha):
    return mix_guidance(denoise_fn(*with_prompt_masked(z, alpha, given, mask_id)), scale)

  return guided


def _run(setting: _Setting, key, prompt, prompt_mask):
  denoise_fn = bounds.checked_denoiser(setting.denoise_fn, setting.mask_id)
  z = _initial_tokens(setting.batch_size, setting.length, setting.mask_id, prompt, prompt_mask)
  if setting.guidance_scale != 0:
    denoise_fn = _guided(denoise_fn, z != setting.mask_id, setting.mask_id, setting.guidance_scale)
  trajectory = None
  if setting.record_trajectory:
    num_records = max_calls(setting.method, setting.length, setting.num_steps, setting.remask_loop)
    trajectory = steps.new_trajectory(z, num_records, setting.mask_id, setting.trajectory_top_k)
  if setting.schedule.state_dependent:
    tokens, nfe, first_bad, trajectory = unmasking.sample_state_dependent(
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
