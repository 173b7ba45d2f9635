"""Few-step students by distillation, in rounds that halve the sampler's steps (`md4jax.app.distill`).

Masked models: Self-Distillation Through Time (SDTT; Deschenaux & Gulcehre, "Beyond
Autoregression: Fast LLMs via Self-Distillation Through Time", 2025). A student called at z_t
learns what the teacher's sampler makes of z_t in two ancestral steps of size dt (t → t − dt →
t − 2dt), so that its own sampler, with steps of 2dt, takes half the teacher's steps. For each
masked position of z_t the target is the law the teacher drew it from: the first step's denoiser
output where that step revealed it, else the second's (revealed then or still masked).

Uniform-state models: DUO's Discrete Consistency Distillation (DCD; Sahoo et al., "The
Diffusion Duality", 2025). z_t and z_s = z_{t − dt} lie on one Gaussian trajectory
(`md4jax.diffusion.duality`), and the student at z_t learns the teacher's prediction at z_s.

The student of one round is the next round's teacher. Pure functions over arrays and
denoisers: `teacher_targets` (one draw of SDTT's targets), `sdtt_draw` / `dcd_draw` (a batch's
times, states and targets), `divergence` (the student's loss at the scored positions) and
`update` (an optimizer step). Every draw is per row (a row's key is fold_in(key, its row index)).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax

from md4jax.diffusion import duality, masking
from md4jax.posttraining.step import apply_gradients
from md4jax.sampling import categorical
from md4jax.training import objective
from md4jax.training import state as state_lib

DIVERGENCES = (
  "reverse_kl",
  "forward_kl",
)  # KL(student ‖ target) (SDTT's default), or KL(target ‖ student).
TEACHER_CALLS = 2  # The teacher's steps a student call stands for (SDTT's num_distill_steps).
# Target log-probs are floored here: KL(student ‖ target) stays finite where the teacher rules a
# token out (a probability below e^-69 ≈ 1e-30, nothing a sampler would draw).
LOG_FLOOR = -69.0


def teacher_targets(key, teacher_fn, z_t, t, dt, schedule, *, mask_id: int, noise="float64"):
  """log target [B, L, V] float32 of every masked position of z_t [B, L] at times t [B]: the
  teacher's law at the step of its two ancestral steps (t → max(t − dt, 0) → max(t − 2dt, 0))
  that revealed it, or at the last step if none did. teacher_fn(z, α [B]) -> logits [B, L, V].
  key: one key (row b draws from fold_in(key, b)) or one per row [B]."""
  keys = masking.row_keys(key, z_t.shape[0])
  z, laws, reveals = z_t, [], []
  for step in range(TEACHER_CALLS):
    now = jnp.maximum(t - step * dt, 0.0)
    then = jnp.maximum(t - (step + 1) * dt, 0.0)
    logits = teacher_fn(z, schedule.alpha(now)).astype(jnp.float32)
    mask_now, mask_then = schedule.mask_prob(now), schedule.mask_prob(then)
    reveal_prob = jnp.where(
      mask_now > 0, (mask_now - mask_then) / jnp.maximum(mask_now, 1e-30), 1.0
    )
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, step)
    reveal_key, draw_key = masking.split_keys(step_keys, 2)
    reveal = (z == mask_id) & (masking.uniform(reveal_key, z.shape) < reveal_prob[:, None])
    drawn = categorical.sample_categorical(draw_key, logits, noise=noise)
    laws.append(jax.nn.log_softmax(logits, axis=-1))
    reveals.append(reveal)
    z = jnp.where(reveal, drawn, z)
  # A step's reveals are masked before it only: each position takes the law of the step that
  # revealed it, and the last step's if none of the earlier ones did.
  target = laws[-1]
  for law, reveal in zip(laws[-2::-1], reveals[-2::-1]):
    target = jnp.where(reveal[..., None], law, target)
  return target


def divergence(student_logits, log_target, masked, kind: str = "reverse_kl"):
  """Σ over the masked positions [B, L] of KL(student ‖ target) ("reverse_kl") or
  KL(target ‖ student) ("forward_kl"), nats per row [B]."""
  if kind not in DIVERGENCES:
    raise ValueError(f"distill.divergence must be one of {', '.join(DIVERGENCES)}, got {kind!r}.")
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  log_p = jnp.maximum(log_target, LOG_FLOOR)
  if kind == "reverse_kl":
    per_position = jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)
  else:
    per_position = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return jnp.where(masked, per_position, 0.0).sum(-1)


def sdtt_draw(key, teacher, tokens, editable, schedule, dt, config):
  """SDTT's (t [B], z_t, log targets, scored positions): t ~ U(0, 1], z_t ~ q_t(· | x) masked,
  the teacher's targets of its masked positions (`teacher_targets`)."""
  mask_id = config.data.vocab_size
  time_key, noise_key, target_key = jax.random.split(key, 3)
  rows = tokens.shape[0]
  t = 1.0 - jax.vmap(jax.random.uniform)(masking.row_keys(time_key, rows))  # (0, 1]
  z_t = masking.corrupt(
    masking.row_keys(noise_key, rows), tokens, schedule.alpha(t), mask_id=mask_id, editable=editable
  )
  log_target = teacher_targets(target_key, teacher, z_t, t, dt, schedule, mask_id=mask_id)
  return t, z_t, log_target, z_t == mask_id


def dcd_draw(key, teacher, tokens, editable, schedule, dt, config):
  """DUO's discrete consistency distillation (uniform process; docs/math.md § 16): t ~ U(dt, 1],
  s = t − dt, and (z_t, z_s) on one Gaussian trajectory (`duality.coupled_states`: each an exact
  draw of the process, z_s the same noise at a higher signal); the target is the teacher's law at
  (z_s, s) for every editable position. Returns (t [B], z_t, log targets, scored positions)."""
  vocab_size = config.data.vocab_size
  time_key, noise_key = jax.random.split(key)
  u = jax.vmap(jax.random.uniform)(masking.row_keys(time_key, tokens.shape[0]))
  t = dt + (1.0 - dt) * (1.0 - u)
  s = t - dt
  dual = duality.of(vocab_size)
  z_t, z_s = duality.coupled_states(
    noise_key, tokens, dual.nu(schedule.alpha(t)), dual.nu(schedule.alpha(s)), vocab_size, editable
  )
  logits = teacher(z_s, schedule.alpha(s)).astype(jnp.float32)
  return t, z_t, jax.nn.log_softmax(logits, axis=-1), editable


def update(
  state: state_lib.TrainState,
  batch: dict,
  key,
  teacher,
  *,
  student_steps,
  model,
  optimizer: optax.GradientTransformation,
  config: ml_collections.ConfigDict,
):
  """One optimizer step of the student (state) on a data batch: the teacher's targets at steps
  of dt = 1 / (2 · student_steps), SDTT's (masked process) or DCD's (uniform), and the
  divergence per valid token (never per scored one). teacher: a `Denoiser` (a network's params
  are its leaves, or the oracle). Returns (state, metrics)."""
  tokens, editable = batch["tokens"], batch["editable"].astype(bool)
  schedule = objective.schedule_of(state.params, config)
  dt = 1.0 / (TEACHER_CALLS * student_steps)
  inputs = {"segment_ids": batch["segment_ids"], "positions": batch["positions"]}
  if teacher.network is not None and any(v is not None for v in inputs.values()):
    teacher = dataclasses.replace(teacher, inputs=inputs)  # The student's documents and padding.
  draw = sdtt_draw if config.diffusion.process == "masked" else dcd_draw
  t, z_t, log_target, scored = draw(key, teacher, tokens, editable, schedule, dt, config)
  log_target = jax.lax.stop_gradient(log_target)
  num_tokens = jnp.maximum(editable.sum(), 1)
  trainable, frozen = state_lib.split_trainable(state.params, config)

  def loss(trainable):
    params = state_lib.join_trainable(trainable, frozen)
    student = objective.sampling_denoiser(
      model, params, config, batch["segment_ids"], batch["positions"]
    )
    nats = divergence(
      student(z_t, schedule.alpha(t)), log_target, scored, config.distill.divergence
    )
    return nats.sum() / num_tokens

  value, grads = jax.value_and_grad(loss)(trainable)
  new_state = apply_gradients(state, grads, frozen, optimizer, config).replace(step=state.step + 1)
  metrics = {
    "loss": value,
    "grad_norm": optax.tree.norm(grads),
    "learning_rate": state_lib.learning_rate_schedule(config)(state.step),
    "scored_fraction": (scored.sum() / num_tokens).astype(jnp.float32),
  }
  return new_state, metrics
