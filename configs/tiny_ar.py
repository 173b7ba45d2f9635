r"""The AR twin of configs/tiny.py: the same blocks with a causal mask and next-token loss.

  python -m md4jax.main --config=configs/tiny_ar.py --workdir=/tmp/md4jax_tiny_ar
"""

from md4jax import config_lib


def get_config():
  config = config_lib.base_config()
  config.batch_size = 16
  config.num_train_steps = 20
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  config.data.vocab_size = 8
  config.data.seq_len = 16
  config.model.type = "ar"
  config.model.num_layers = 1
  config.model.model_dim = 32
  config.model.num_heads = 2
  config.model.mlp_dim = 64
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 5
  config.optimizer.ema_decay = 0.9
  config.eval.num_sequences = 32
  config.eval.batch_size = 16
  config.sample.num_samples = 2
  return config
