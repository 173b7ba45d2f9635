r"""A tiny masked diffusion model on the generated Markov language: runs in seconds (tests, smoke runs).

python -m md4jax.main --config=configs/tiny.py --workdir=/tmp/md4jax_tiny
"""

from md4jax import config as config_lib


def get_config():
  config = config_lib.base_config()
  config.batch_size = 16
  config.num_train_steps = 20
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.data.vocab_size = 8
  config.data.seq_len = 16
  config.model.num_layers = 1
  config.model.model_dim = 32
  config.model.num_heads = 2
  config.model.mlp_dim = 64
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 5
  config.optimizer.ema_decay = 0.9
  config.eval.num_sequences = 32
  config.eval.num_mc_samples = 2
  config.eval.num_discrete_draws = 2
  config.eval.batch_size = 16
  config.sample.num_samples = 2
  config.sample.num_steps = 8
  return config
