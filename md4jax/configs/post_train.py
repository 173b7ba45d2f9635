r"""Post-training the README's default model with a reward (docs/post_training.md): RLOO with a
β-KL to the model itself, on a bigram reward over the generated language, whose KL-regularised
optimum is known exactly (docs/math.md § 11).

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default
  python -c "import numpy as np; np.save('/tmp/reward.npy', np.random.default_rng(0).normal(size=(32, 32)))"
  python -m md4jax.main --config=configs/post_train.py --workdir=/tmp/md4jax_post_train \
      --mode=post_train --config.post_train.init_from=/tmp/md4jax_default \
      --config.post_train.reward=bigram:/tmp/reward.npy
  python benchmarks/post_training_optimum.py --base=/tmp/md4jax_default \
      --post=/tmp/md4jax_post_train --reward=/tmp/reward.npy --beta=1.0
"""

from md4jax.configs import default


def get_config():
  config = default.get_config()  # The network and data of the workdir it starts from.
  config.batch_size = 8  # Prompts (groups) per step: 8 × post_train.group_size = 64 rollouts.
  config.num_train_steps = 200  # Post-training steps (one batch of rollouts each).
  config.log_every_steps = 10  # Steps between metrics.jsonl records and progress lines.
  config.checkpoint_every_steps = 50  # Steps between checkpoints; the last step always saves.
  config.optimizer.learning_rate = 1e-3  # Peak learning rate of the policy's updates.
  config.optimizer.warmup_steps = 10  # Linear warmup steps.
  config.optimizer.ema_decay = 0.0  # The EMA copies the params: sampling reads the latest policy.
  config.sample.num_steps = 32  # Rollout sampler steps (sample.method: ancestral).
  config.sample.trajectory = False  # No trajectory files for the final samples.
  config.post_train.algorithm = "rloo"  # Leave-one-out baselines: unbiased, no std scaling.
  config.post_train.beta = 1.0  # The KL's weight: the optimum is π_ref · exp(r / 1.0), normalised.
  config.post_train.group_size = 8  # Rollouts per group.
  config.post_train.likelihood = "nelbo"  # Mask-count draws of the NELBO per log π estimate.
  config.post_train.likelihood_draws = 4  # Draws per estimate: 4 calls, a quarter the variance.
  return config
