"""The validator of config.distill (--mode=distill, docs/distillation.md), for `validate_config`.
What only a distillation run needs (init_from, a masked whole-sequence model) is checked when it
starts (`md4jax.app.distill.check_run`)."""

import ml_collections

from md4jax.config.values import check, check_choice, check_positive_int
from md4jax.posttraining import distillation

TEACHERS = ("", "oracle")


def validate_distillation(config: ml_collections.ConfigDict):
  """Raises ValueError naming the key for an invalid distill setting."""
  cfg = config.distill
  check_choice(cfg.teacher, "distill.teacher", TEACHERS)
  check_choice(cfg.divergence, "distill.divergence", distillation.DIVERGENCES)
  check_positive_int(config, "distill.rounds")
  check_positive_int(config, "distill.teacher_steps")
  check(
    isinstance(cfg.init_from, str), f"distill.init_from must be a string, got {cfg.init_from!r}."
  )
  check(
    cfg.teacher_steps % 2**cfg.rounds == 0,
    f"distill.teacher_steps={cfg.teacher_steps} must be divisible by 2^distill.rounds = "
    f"{2**cfg.rounds}: each round halves the steps.",
  )
