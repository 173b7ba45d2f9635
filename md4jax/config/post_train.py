"""The validator of config.post_train (--mode=post_train, docs/post_training.md), for
`validate_config`. What only a post-training run needs (init_from, the reward or the pairs, the
model's kind) is checked when it starts (`md4jax.app.post_train.check_run`)."""

import math

import ml_collections

from md4jax.config.values import check, check_choice, check_positive_int
from md4jax.diffusion import log_likelihood
from md4jax.posttraining import objectives


def validate_post_training(config: ml_collections.ConfigDict):
  """Raises ValueError naming the key for an invalid post_train setting."""
  cfg = config.post_train
  check_choice(cfg.algorithm, "post_train.algorithm", objectives.ALGORITHMS)
  check_choice(cfg.likelihood, "post_train.likelihood", log_likelihood.ESTIMATORS)
  for name in ("group_size", "updates_per_rollout", "likelihood_draws"):
    check_positive_int(config, f"post_train.{name}")
  check(
    cfg.group_size >= 2,
    f"post_train.group_size must be >= 2 (a group of one has no advantage), got {cfg.group_size}.",
  )
  check(
    isinstance(cfg.beta, float) and math.isfinite(cfg.beta) and cfg.beta >= 0,
    f"post_train.beta must be a finite number >= 0 (the KL coefficient), got {cfg.beta!r}.",
  )
  check(
    isinstance(cfg.clip, float) and cfg.clip > 0,
    f"post_train.clip must be > 0 (PPO's ε), got {cfg.clip!r}.",
  )
  check(
    0.0 <= cfg.prompt_mask_prob < 1.0,
    f"post_train.prompt_mask_prob must be in [0, 1), got {cfg.prompt_mask_prob!r}.",
  )
  for name in ("init_from", "reward", "pairs"):
    check(isinstance(cfg[name], str), f"post_train.{name} must be a string, got {cfg[name]!r}.")
