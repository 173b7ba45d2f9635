r"""The embedded default: a masked diffusion LM learns a generated Markov language of known entropy.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default

Trains, evaluates and samples in one to two minutes on 2 CPU cores (timings:
docs/performance.md), then prints the NELBO in bits/token ± its standard error, the language's
exact entropy and the gap between them in %.

Block diffusion (BD3-LM) on the same language, blocks of 16 tokens (any b dividing 64 with
--config.diffusion.block_size=b; 1 is an autoregressive model):

  python -m md4jax.main --config=configs/default.py:bd3 --workdir=/tmp/md4jax_default_bd3

Uniform-state diffusion (UDLM, DUO: tokens redrawn uniformly instead of masked; docs/math.md
§ 13) on the same language, with its own bound, estimator and sampler:

  python -m md4jax.main --config=configs/default.py:uniform --workdir=/tmp/md4jax_default_uniform

Both at once: block diffusion under uniform noise, blocks of 16 sampled one after another through
the exact KV cache (each block from uniform noise, a network reading each position's noise level):

  python -m md4jax.main --config=configs/default.py:uniform_bd3 --workdir=/tmp/md4jax_uniform_bd3
"""

from md4jax import config as config_lib


def get_config(variant: str = ""):
  """variant "" is the masked diffusion LM; "bd3" block diffusion; "uniform" uniform-state;
  "uniform_bd3" block diffusion under uniform noise."""
  variants = ("", "bd3", "uniform", "uniform_bd3")
  if variant not in variants:
    raise ValueError(
      f"Unknown default variant {variant!r}; valid: '' (mdm), {', '.join(map(repr, variants[1:]))}."
    )
  config = config_lib.base_config()
  config.batch_size = 64
  # With b1 = 0.7, 1800 steps reach the mean gap (seeds 0-2) of 2000 steps at b1 = 0.9.
  config.num_train_steps = 1800
  config.log_every_steps = 100
  config.eval_every_steps = 1800  # Evaluate once, at the end.
  config.checkpoint_every_steps = 500
  # Each step's temporaries then reuse pages instead of faulting in fresh ones from the kernel.
  config.reuse_freed_host_memory = True
  # A device per core: each runs its half of the batch whole, faster than two cores sharing
  # one batch's many small ops.
  config.cpu_devices = 2
  # 32 tokens, Dirichlet(0.3) transitions: 3.60 bits/token of entropy against 5 for uniform.
  config.data.vocab_size = 32
  config.data.seq_len = 64
  config.data.concentration = 0.3
  config.model.num_layers = 2
  config.model.model_dim = 64
  config.model.num_heads = 2
  config.model.mlp_dim = 128
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 100
  config.optimizer.b1 = 0.7  # Less momentum than the base's 0.9 learns faster in this short run.
  config.optimizer.ema_decay = 0.99
  # Same objective as "standard" in expectation, lower-variance gradients: learns faster.
  config.training.estimator = "mask_count"
  # 1024 sequences x 16 draws: a standard error near 0.2% of the entropy, for seconds of compute.
  config.eval.num_sequences = 1024
  config.eval.num_mc_samples = 16
  config.eval.batch_size = 128
  config.sample.num_samples = 4
  config.sample.num_steps = 64
  if variant in ("bd3", "uniform_bd3"):
    config.diffusion.block_size = 16
    config.training.estimator = "standard"  # The two-stream pass scores every masked token.
    config.sample.num_steps = 16  # Per block.
  if variant in ("uniform", "uniform_bd3"):
    config.diffusion.process = "uniform"
    # Its posterior depends on the noise level (a masked one does not): the network reads α.
    config.model.time_conditioning = "adaln"
    # Its one estimator; t = u² keeps its variance finite (md4jax.diffusion.uniform).
    config.training.estimator = "standard"
    config.eval.estimator = "standard"
    config.frontier.methods = "ancestral"
  return config
