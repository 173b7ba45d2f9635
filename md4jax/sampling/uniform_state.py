"""Samplers of the uniform-state process (docs/math.md § 13): `sample(…, process="uniform")`.

Every editable position starts as a uniform draw over the V tokens (the process at α = 0) and
any token may change at any step; given positions (a prompt) never change. On the grid
t_i = i/T, from i = T down to 1, each step calls denoise_fn(z, α(t_i)) once:

  ancestral    the exact reverse step of the model: every position draws z_s from
               Σ_y μ(y) q(z_s | z_t, x = y) (`diffusion.uniform.reverse_probs`); the last
               step (α(0) = 1) draws from μ itself. With the exact posterior its law tends to
               the data's as T grows (the per-position factorization is the only error).
  greedy_tail  DUO's: ancestral, but the last step takes the most probable token of μ.
  canvas       DiffusionGemma-style refinement (a heuristic, priced on the leaderboard, not
               exact): each step draws a clean estimate x̂ from μ, keeps the round(α(s) · n)
               most confident editable positions (probability of the token drawn) at x̂ and
               redraws the others uniformly; at s = 0 everything is kept.

A self-conditioned denoiser (model.self_condition) reads each call's estimate of x_0 (its
softmax) at the next call, none at the first: one network call per step.

A schedule with α(0) < 1 ends with one more call at α(0) whose μ is drawn (greedy_tail: its
argmax). Temperature, top-k and top-p filter μ. Draws are per row (a row's tokens depend on its
key only) with float64-accurate Gumbel noise.
"""

import inspect
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion import masking, uniform
from md4jax.diffusion.denoiser import Denoiser, as_denoiser, estimate
from md4jax.sampling import categorical, steps

METHODS = ("ancestral", "greedy_tail", "canvas")


def max_calls(num_steps: int, schedule) -> int:
  """Network calls of a sample: T, and one more where α(0) < 1."""
  return num_steps + int(schedule.needs_reconstruction_term)


def run(
  key,
  denoise_fn,
  given: jax.Array,
  editable: jax.Array,
  *,
  schedule,
  method: str = "ancestral",
  num_steps: int = 64,
  temperature: float = 1.0,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
  noise: str = "float64",
):
  """Samples the editable positions of given [B, L] (the others are kept): (tokens [B, L] int32,
  info with "nfe" and "nonfinite_call"). `key`: one key (row b from fold_in(key, b)) or one per
  row [B]."""
  if method not in METHODS:
    raise ValueError(f"process='uniform' samples with {', '.join(METHODS)}; got method={method!r}.")
  batch, length = given.shape
  vocab_size = jax.eval_shape(denoise_fn, given, jnp.ones((batch,), jnp.float32)).shape[-1]
  init_key, loop_key, end_key = masking.split_keys(masking.row_keys(key, batch), 3)
  given = given.astype(jnp.int32)
  z = jnp.where(editable, uniform.uniform_tokens(init_key, given.shape, vocab_size), given)

  denoiser = as_denoiser(denoise_fn)
  carries = denoiser.self_conditioned  # Passes each call's estimate of x_0 to the next.
  previous = jnp.zeros((batch, length, vocab_size), jnp.float32) if carries else None

  def call(z, t, index, first_bad, previous):
    alpha = jnp.full((batch,), schedule.alpha(t), jnp.float32)
    logits = denoiser(z, alpha, previous)
    bad = steps.nonfinite_rows(logits, jnp.where(editable, -1, z), -1)
    filtered = categorical.filter_logits(
      logits.astype(jnp.float32), temperature=temperature, top_k=top_k, top_p=top_p
    )
    if temperature == 0:  # Greedy: μ is the most probable token.
      top = jax.nn.one_hot(jnp.argmax(filtered, -1), filtered.shape[-1], dtype=jnp.bool_)
      filtered = jnp.where(top, 0.0, -jnp.inf)
    previous = estimate(logits) if carries else None
    return alpha, filtered, steps.first_bad_call(first_bad, index, bad), previous

  def draw(step_key, log_weights):
    return categorical.sample_categorical(step_key, log_weights, noise=noise)

  def step(i, carry):
    z, first_bad, previous = carry
    t = (num_steps - i) / num_steps
    s = (num_steps - i - 1) / num_steps
    alpha_t, filtered, first_bad, previous = call(z, t, i, first_bad, previous)
    alpha_s = jnp.full((batch,), schedule.alpha(s), jnp.float32)
    keys = jax.vmap(jax.random.fold_in, (0, None))(loop_key, i)
    probs = jax.nn.softmax(filtered, axis=-1)
    if method == "canvas":
      estimate_key, noise_key = masking.split_keys(keys, 2)
      estimate = draw(estimate_key, filtered)
      confidence = jnp.take_along_axis(probs, estimate[..., None], axis=-1)[..., 0]
      keep_count = jnp.round(alpha_s * editable.sum(-1))
      rank = jnp.argsort(jnp.argsort(-jnp.where(editable, confidence, -1.0), axis=-1), axis=-1)
      redrawn = uniform.uniform_tokens(noise_key, z.shape, vocab_size)
      new = jnp.where(rank < keep_count[:, None], estimate, redrawn)
    else:
      new = draw(keys, jnp.log(uniform.reverse_probs(probs, z, alpha_t, alpha_s)))
      if method == "greedy_tail" and not schedule.needs_reconstruction_term:
        new = jnp.where(i == num_steps - 1, jnp.argmax(filtered, -1).astype(jnp.int32), new)
    return jnp.where(editable, new, z), first_bad, previous

  z, first_bad, previous = jax.lax.fori_loop(0, num_steps, step, (z, jnp.int32(-1), previous))
  if schedule.needs_reconstruction_term:  # The last step reached α(0) < 1: read x off μ.
    _, filtered, first_bad, _ = call(z, 0.0, num_steps, first_bad, previous)
    final = jnp.argmax(filtered, -1) if method == "greedy_tail" else draw(end_key, filtered)
    z = jnp.where(editable, final.astype(jnp.int32), z)
  return z, {"nfe": jnp.int32(max_calls(num_steps, schedule)), "nonfinite_call": first_bad}


_STATIC = ("schedule", "method", "num_steps", "temperature", "top_k", "top_p", "noise")
_run_jit = jax.jit(run, static_argnames=_STATIC)
_PLAIN_PROGRAMS = weakref.WeakKeyDictionary()  # {a plain denoise_fn: its jitted run}


def check_settings(refused: dict, settings: dict):
  """One-line errors for an option the uniform process does not take (refused: {option: (given,
  the only value taken)}), a masked-process method, num_steps < 1 or a learned schedule."""
  for name, (value, only) in refused.items():
    if value != only:
      raise ValueError(f"sample: process='uniform' takes {name}={only!r} only (got {value!r}).")
  if settings["method"] not in METHODS:
    raise ValueError(
      f"sample: process='uniform' samples with {', '.join(METHODS)}; got "
      f"method={settings['method']!r} (a masked-process sampler)."
    )
  num_steps = settings["num_steps"]
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"sample: process='uniform' needs num_steps >= 1, got {num_steps!r}.")
  if settings["schedule"].state_dependent:
    raise ValueError("sample: process='uniform' takes a mask-rate schedule, not GenMD4's.")


def vocab_size_of(denoise_fn, batch_size: int, length: int) -> int:
  """V, the last axis of denoise_fn's logits."""
  tokens = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)
  alpha = jax.ShapeDtypeStruct((batch_size,), jnp.float32)
  return jax.eval_shape(denoise_fn, tokens, alpha).shape[-1]


def check_prompt_ids(prompt, vocab_size: int):
  """A concrete prompt's ids lie in [0, V): the uniform process has no mask id."""
  if isinstance(prompt, jax.core.Tracer):
    return
  ids = np.asarray(prompt)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(
      f"sample: prompt ids must be in [0, {vocab_size}) (the uniform process has no mask id), "
      f"got {ids.min()}..{ids.max()}."
    )


def sample(
  key,
  denoise_fn,
  *,
  batch_size: int,
  length: int,
  prompt=None,
  prompt_mask=None,
  refused: dict,
  **settings,
):
  """`md4jax.sample` with process="uniform": (tokens [B, length] int32, info). A prompt's
  positions (all of them, or where prompt_mask is True) are given and never change. refused:
  {option: (given, the only value this process takes)}, each a one-line error otherwise."""
  check_settings(refused, settings)
  given = jnp.zeros((batch_size, length), jnp.int32)
  editable = jnp.ones((batch_size, length), jnp.bool_)
  if prompt is not None:
    check_prompt_ids(prompt, vocab_size_of(denoise_fn, batch_size, length))
    prompt = jnp.atleast_2d(jnp.asarray(prompt, jnp.int32))
    if prompt.ndim != 2 or prompt.shape[0] not in (1, batch_size):
      raise ValueError(
        f"sample: prompt must be [P] or [batch_size={batch_size}, P], got {prompt.shape}."
      )
    prompt = jnp.broadcast_to(prompt, (batch_size, prompt.shape[1]))
    width = prompt.shape[1]
    if width > length:
      raise ValueError(f"sample: the prompt has {width} tokens, more than length={length}.")
    shown = (
      jnp.ones(prompt.shape, jnp.bool_)
      if prompt_mask is None
      else jnp.broadcast_to(jnp.atleast_2d(jnp.asarray(prompt_mask, jnp.bool_)), prompt.shape)
    )
    given = given.at[:, :width].set(jnp.where(shown, prompt, 0))
    editable = editable.at[:, :width].set(~shown)
  if isinstance(denoise_fn, Denoiser):
    return _run_jit(key, denoise_fn, given, editable, **settings)
  return _program(denoise_fn, settings)(key, given, editable)


def _program(denoise_fn, settings: dict):
  """run(key, given, editable) of a plain function, jitted once per function and settings (held
  weakly by the function; a bound method or an unreferenceable callable: this call's own)."""
  frozen = tuple(sorted(settings.items()))
  try:
    programs = None if inspect.ismethod(denoise_fn) else _PLAIN_PROGRAMS.setdefault(denoise_fn, {})
  except TypeError:
    programs = None
  if programs is None:
    return jax.jit(lambda key, given, editable: run(key, denoise_fn, given, editable, **settings))
  if frozen not in programs:
    reference = weakref.ref(denoise_fn)
    programs[frozen] = jax.jit(
      lambda key, given, editable: run(key, reference(), given, editable, **settings)
    )
  return programs[frozen]
