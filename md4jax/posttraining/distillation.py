"""Few-step students of a masked diffusion LM by Self-Distillation Through Time (SDTT; Deschenaux
& Gulcehre, "Beyond Autoregression: Fast LLMs via Self-Distillation Through Time", 2025).

A student called at z_t learns what the teacher's sampler makes of z_t in two ancestral steps
of size dt (t → t − dt → t − 2dt), so that its own sampler, with steps of 2dt, takes half the
teacher's steps. For each masked position of z_t the target is the law the teacher drew it
from: the first step's denoiser output where that step revealed it, else the second's (revealed
then or still masked). Rounds halve the steps again: the student of one round is the next
round's teacher (`md4jax.app.distill`).

Pure functions over arrays and denoisers: `teacher_targets` (one draw of the targets),
`divergence` (the student's loss at the masked positions) and `update` (an optimizer step).
Every draw is per row (a row's key is fold_in(key, its row index)).
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from md4jax.diffusion import masking
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
  """One optimizer step of the student (state) on a data batch: z_t at t ~ U(0, 1] per row, the
  teacher's targets at steps of dt = 1 / (2 · student_steps) and the divergence per valid token
  (never per masked one). teacher: a `Denoiser` (a network's params are its leaves, or the
  oracle). Returns (state, metrics)."""
  tokens, editable = batch["tokens"], batch["editable"].astype(bool)
  schedule = objective.schedule_of(state.params, config)
  mask_id = config.data.vocab_size
  time_key, noise_key, target_key = jax.random.split(key, 3)
  rows = tokens.shape[0]
  t = 1.0 - jax.vmap(jax.random.uniform)(masking.row_keys(time_key, rows))  # (0, 1]
  z_t = masking.corrupt(
    masking.row_keys(noise_key, rows), tokens, schedule.alpha(t), mask_id=mask_id, editable=editable
  )
  dt = 1.0 / (TEACHER_CALLS * student_steps)
  log_target = jax.lax.stop_gradient(
    teacher_targets(target_key, teacher, z_t, t, dt, schedule, mask_id=mask_id)
  )
  masked = z_t == mask_id
  num_tokens = jnp.maximum(editable.sum(), 1)
  trainable, frozen = state_lib.split_trainable(state.params, config)

  def loss(trainable):
    params = state_lib.join_trainable(trainable, frozen)
    student = objective.sampling_denoiser(
      model, params, config, batch["segment_ids"], batch["positions"]
    )
    nats = divergence(
      student(z_t, schedule.alpha(t)), log_target, masked, config.distill.divergence
    )
    return nats.sum() / num_tokens

  value, grads = jax.value_and_grad(loss)(trainable)
  new_state = apply_gradients(state, grads, frozen, optimizer, config).replace(step=state.step + 1)
  metrics = {
    "loss": value,
    "grad_norm": optax.tree.norm(grads),
    "learning_rate": state_lib.learning_rate_schedule(config)(state.step),
    "masked_fraction": (masked.sum() / num_tokens).astype(jnp.float32),
  }
  return new_state, metrics
