r"""A four-step student of the README's default model (docs/distillation.md): four rounds, each
halving the ancestral sampler's steps, 64 -> 32 -> 16 -> 8 -> 4. SDTT for the masked default;
DUO's consistency distillation (DCD) for the uniform-state one (":uniform").

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default
  python -m md4jax.main --config=configs/distill.py --workdir=/tmp/md4jax_distill \
      --mode=distill --config.distill.init_from=/tmp/md4jax_default

  python -m md4jax.main --config=configs/default.py:uniform --workdir=/tmp/md4jax_default_uniform
  python -m md4jax.main --config=configs/distill.py:uniform --workdir=/tmp/md4jax_distill_uniform \
      --mode=distill --config.distill.init_from=/tmp/md4jax_default_uniform

With --config.distill.teacher=oracle the first round's teacher is the exact denoiser of the
generated language instead of the trained model.
"""

from md4jax.configs import default


def get_config(variant: str = ""):
  """variant "" distills the masked default (SDTT), "uniform" the uniform-state one (DCD)."""
  if variant not in ("", "uniform"):
    raise ValueError(f"Unknown distill variant {variant!r}; valid: '' (masked), 'uniform'.")
  config = default.get_config(variant)  # The network and data of the workdir it starts from.
  config.num_train_steps = 1600  # Four rounds of 400 optimizer steps.
  config.log_every_steps = 100  # Steps between metrics.jsonl records and progress lines.
  config.checkpoint_every_steps = 400  # Every round's end (each kept: the next round's teacher).
  config.optimizer.learning_rate = (
    3e-4  # The student starts trained: smaller steps than training's.
  )
  config.optimizer.warmup_steps = 20  # Linear warmup steps.
  config.optimizer.ema_decay = 0.99  # The EMA samples and teaches the next round.
  config.distill.teacher_steps = 64  # The default model's sampler: 64 ancestral steps.
  config.distill.rounds = 4  # 64 / 2^4 = 4 steps for the last student.
  config.distill.divergence = "reverse_kl"  # KL(student ‖ teacher), SDTT's choice.
  config.sample.num_steps = 4  # The last student's steps.
  config.sample.trajectory = False  # No trajectory files for the final samples.
  return config
