"""The reverse-process samplers of one block (docs/math.md, "Reverse process"): every method of
`md4jax.sample`, which runs them block after block (`md4jax.sampling.decoder`).

Pure, traceable functions over any `denoise_fn(z, alpha) -> logits [B, L, V]` with V == mask_id;
loops are `lax.fori_loop` / `lax.while_loop`. `run` samples one block from its initial tokens;
`Settings` is everything but the key, the denoiser and the tokens (static for jit), and
`check_settings` the one check of them that `sample` and the config validation share.

Every loop is bounded by the calls its method states (`max_calls`): the adaptive ones
(jump, first_hitting, threshold, confidence with the schedule's counts) reveal at least one
masked position of every unfinished row per call, whatever the logits (confidence's other
counts reveal what their rule says, all that is left by the last step), and no method returns
the mask id. Logits
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
                 reveals the most confident masked positions (`confidence`: LLaDA's
                 low_confidence is "drawn_prob", Dream's maskgit_plus
                 "drawn_filtered_prob"; at temperature 0 both are "max_prob"), as many
                 as `reveal_counts` says: "schedule", all but the schedule's share of
                 the initial masks and at least one per sequence; "even", LLaDA's
                 equal split of the block's masks over the T steps; "proportional",
                 Dream's share 1 − s/t of the masks left (`unmasking.reveal_count`).
                 It stops when nothing is masked (≤ min(T, L) calls; "proportional":
                 T, since a mask is left until its last step).
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

Every draw is per row: `run` takes one key, whose row b draws from fold_in(key, b), or one key
per row [B]; either way a row's tokens depend on its own key alone, not on the other rows.
"""

import dataclasses
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import bounds, masking
from md4jax.diffusion.denoiser import Denoiser, estimate
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
from md4jax.sampling.unmasking import CONFIDENCES, REVEAL_COUNTS

__all__ = [
  "CONFIDENCES",
  "METHODS",
  "NonFiniteLogitsError",
  "REMASKS",
  "REVEAL_COUNTS",
  "Settings",
  "TIME_FREE_METHODS",
  "TIME_GRIDS",
  "check_logits",
  "check_settings",
  "max_calls",
  "run",
  "time_grid",
]

Array = jax.Array

METHODS = ("ancestral", "cached", "jump", "first_hitting", "confidence", "threshold", "remdm")
TIME_FREE_METHODS = ("cached", "jump")  # Exact only for a denoiser that ignores α.


@dataclasses.dataclass(frozen=True)
class Settings:
  """A block sampler's settings: static for jit, one hashable cache key (`check_settings`)."""

  schedule: object
  mask_id: int
  method: str = "ancestral"
  num_steps: Optional[int] = None
  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None
  time_grid_kind: str = "uniform"
  confidence: str = "max_prob"
  reveal_counts: str = "schedule"
  threshold: Optional[float] = None
  noise: str = "float64"
  remask: str = "cap"
  remask_eta: float = 0.0
  remask_loop: int = 0
  remask_loop_alpha: float = 0.9
  record_trajectory: bool = False
  trajectory_top_k: int = 5

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

  def max_calls(self, length: int) -> int:
    """The calls a block of `length` positions takes at most."""
    return max_calls(self.method, length, self.num_steps, self.remask_loop, self.reveal_counts)


# One signature for every sampler: (settings, key, call, z, trajectory, previous) ->
# (tokens, calls, first broken call or −1, trajectory); call(z, alpha, previous) -> (logits,
# the estimate the next call reads) (`_calls`).
_SAMPLERS = {
  "ancestral": lambda s, key, f, z, tr, pr: unmasking.sample_ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, False, s.draw, tr, pr
  ),
  "cached": lambda s, key, f, z, tr, pr: unmasking.sample_ancestral(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, True, s.draw, tr, pr
  ),
  "jump": lambda s, key, f, z, tr, pr: unmasking.sample_jump(
    key, f, z, s.schedule, s.mask_id, s.num_steps, s.time_grid_kind, s.draw, tr, pr
  ),
  "first_hitting": lambda s, key, f, z, tr, pr: unmasking.sample_first_hitting(
    key, f, z, s.mask_id, s.draw, tr, pr
  ),
  "confidence": lambda s, key, f, z, tr, pr: unmasking.sample_confidence(
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
    s.reveal_counts,
    pr,
  ),
  "threshold": lambda s, key, f, z, tr, pr: unmasking.sample_threshold(
    key, f, z, s.mask_id, s.threshold, s.draw, s.filtered, tr, pr
  ),
  "remdm": lambda s, key, f, z, tr, pr: remasking.sample_remdm(
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
    pr,
  ),
}
assert set(_SAMPLERS) == set(METHODS)


def run(settings: Settings, key, denoise_fn, z):
  """Samples the masked positions of z [B, L] (the others are given and never change): (tokens,
  calls, the first call whose logits were broken or −1, trajectory or None). `key` is one key
  (row b draws from fold_in(key, b)) or one key per row [B]."""
  key = masking.row_keys(key, z.shape[0])
  call, previous = _calls(denoise_fn, z.shape, settings.mask_id)
  denoise_fn = bounds.checked_denoiser(denoise_fn, settings.mask_id)
  trajectory = None
  if settings.record_trajectory:
    num_records = settings.max_calls(z.shape[1])
    trajectory = steps.new_trajectory(z, num_records, settings.mask_id, settings.trajectory_top_k)
  if settings.schedule.state_dependent:
    s = settings
    return unmasking.sample_state_dependent(
      key,
      denoise_fn,
      z,
      s.schedule,
      s.mask_id,
      s.num_steps,
      s.time_grid_kind,
      s.probs,
      s.noise,
      trajectory,
    )
  return _SAMPLERS[settings.method](settings, key, call, z, trajectory, previous)


def _calls(denoise_fn, shape, mask_id):
  """(call(z, alpha, previous) -> (logits float32, what the next call reads), the first call's
  previous). A self-conditioned Denoiser with passes=1 reads the last call's estimate of x_0
  (zeros, no estimate, at the first call) and hands its own on: one network call a step. Any
  other denoiser is called plainly (passes=2 reads its own first pass of the same state)."""
  if not (
    isinstance(denoise_fn, Denoiser) and denoise_fn.self_conditioned and denoise_fn.passes == 1
  ):
    checked = bounds.checked_denoiser(denoise_fn, mask_id)
    return lambda z, alpha, previous: (checked(z, alpha).astype(jnp.float32), None), None

  def call(z, alpha, previous):
    logits = bounds.checked_denoiser(lambda z, alpha: denoise_fn(z, alpha, previous), mask_id)(
      z, alpha
    ).astype(jnp.float32)
    return logits, estimate(logits)

  return call, jnp.zeros(shape + (mask_id,), jnp.float32)


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


def _is_integer(value) -> bool:
  """An integer (a NumPy one too), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_settings(
  *,
  schedule,
  method: str,
  num_steps: Optional[int],
  threshold: Optional[float],
  temperature: float,
  top_k: Optional[int],
  top_p: Optional[float],
  noise: str = "float64",
  time_grid_kind: str = "uniform",
  confidence: str = "max_prob",
  reveal_counts: str = "schedule",
  remask: str = "cap",
  remask_eta: float = 0.0,
  remask_loop: int = 0,
  remask_loop_alpha: float = 0.9,
  guidance_scale: float = 0.0,
  has_prompt: bool = True,
  name: Callable[[str], str] = str,
):
  """Raises ValueError for settings no sampler takes, naming each setting as name(argument)
  (the config's validation passes lambda k: f"sample.{k}")."""

  def require(condition, message):
    if not condition:
      raise ValueError(message)

  def choice(value, argument, what, choices):
    require(
      value in choices,
      f"{name(argument)}={value!r} is unknown; valid {what}: {', '.join(choices)}.",
    )

  require(
    hasattr(schedule, "state_dependent"),
    f"{name('schedule')} must be a schedule (md4jax.get_schedule(name)), got {schedule!r}.",
  )
  choice(method, "method", "sampling methods", METHODS)
  require(
    not schedule.state_dependent or method == "ancestral",
    f"The state-dependent schedule {schedule.name!r} samples with method='ancestral' only, "
    f"got {name('method')}={method!r}.",
  )
  require(
    method in ("first_hitting", "threshold") or (_is_integer(num_steps) and num_steps >= 1),
    f"method={method!r} needs {name('num_steps')} >= 1, got {num_steps!r}.",
  )
  require(
    (method == "threshold") == (threshold is not None)
    and (threshold is None or 0 <= threshold <= 1),
    f"method='threshold' needs a {name('threshold')} in [0, 1], and only it takes one; got "
    f"method={method!r}, threshold={threshold!r}.",
  )
  choice(noise, "noise", "noises", categorical.NOISE_KINDS)
  choice(time_grid_kind, "time_grid_kind", "time grids", TIME_GRIDS)
  choice(confidence, "confidence", "confidences", CONFIDENCES)
  choice(reveal_counts, "reveal_counts", "reveal counts", REVEAL_COUNTS)
  require(
    reveal_counts == "schedule" or method == "confidence",
    f"{name('reveal_counts')}={reveal_counts!r} applies to method='confidence' only; got "
    f"{name('method')}={method!r}.",
  )
  require(temperature >= 0, f"{name('temperature')} must be >= 0, got {temperature}.")
  require(
    top_k is None or (_is_integer(top_k) and top_k >= 1),
    f"{name('top_k')} must be an integer >= 1 or off, got {top_k!r}.",
  )
  require(
    top_p is None or 0 < top_p <= 1, f"{name('top_p')} must be in (0, 1] or off, got {top_p}."
  )
  choice(remask, "remask", "remask strategies", REMASKS)
  require(0 <= remask_eta <= 1, f"{name('remask_eta')} must be in [0, 1], got {remask_eta}.")
  require(
    _is_integer(remask_loop) and remask_loop >= 0,
    f"{name('remask_loop')} must be an integer >= 0, got {remask_loop!r}.",
  )
  require(
    0 < remask_loop_alpha < 1,
    f"{name('remask_loop_alpha')} must be in (0, 1), got {remask_loop_alpha}.",
  )
  require(guidance_scale >= 0, f"{name('guidance_scale')} must be >= 0, got {guidance_scale}.")
  require(
    guidance_scale == 0 or has_prompt,
    f"{name('guidance_scale')} needs a prompt ({name('prompt')}): guidance contrasts the "
    "prompt with the prompt masked.",
  )
