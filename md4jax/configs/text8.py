r"""MD4 on text8 with the paper's settings: sequence 256, 12 layers, width 768, 12 heads,
linear schedule, AdamW 3e-4, batch 512, warmup 2000, EMA 0.9999, 1M steps.

Check that it fits a TPU slice on any CPU machine (pip install -e ".[tpu]"):

  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/text8.py --topology=v5e:2x2

  python -m md4jax.main --config=configs/text8.py --workdir=/tmp/md4jax_text8 \
      --config.data.path=/path/to/text8

data.path is the text8 corpus (`text8` or `text8.zip`, split 90M/5M/5M) or any text8-format
file (a-z and single spaces, split 90/5/5 by position). `configs/text8.py:cpu` is a
CPU-sized variant (0.22M parameters) that trains, evaluates and samples in under
20 minutes on 2 CPU cores (docs/performance.md):

  python -m md4jax.main --config=configs/text8.py:cpu --workdir=/tmp/md4jax_text8_cpu \
      --config.data.path=text8.zip

`configs/text8.py:cpu_bd3` is the CPU variant as block diffusion (BD3-LM), blocks of 16
characters (--config.diffusion.block_size=b for another b dividing 128):

  python -m md4jax.main --config=configs/text8.py:cpu_bd3 --workdir=/tmp/md4jax_text8_bd3 \
      --config.data.path=text8.zip

A short smoke run of the paper model:

  python -m md4jax.main --config=configs/text8.py --workdir=/tmp/md4jax_text8_smoke \
      --config.data.path=text8.zip --config.batch_size=2 \
      --config.num_train_steps=3 --config.optimizer.warmup_steps=1 --config.eval.num_sequences=2 \
      --config.eval.batch_size=2 --config.sample.num_samples=1 --config.sample.num_steps=4
"""

from md4jax import config as config_lib


def get_config(variant: str = ""):
  """variant "" is the paper's setting; "cpu" a small model for a laptop; "cpu_bd3" that model
  as block diffusion."""
  if variant not in ("", "cpu", "cpu_bd3"):
    raise ValueError(f"Unknown text8 variant {variant!r}; valid: '' (paper), 'cpu', 'cpu_bd3'.")
  config = config_lib.base_config()
  config.batch_size = 512
  config.num_train_steps = 1_000_000
  config.log_every_steps = 1000
  config.eval_every_steps = 50_000
  config.checkpoint_every_steps = 10_000
  config.data.dataset = "text8"
  config.data.vocab_size = 27
  config.data.seq_len = 256
  config.data.path = (
    "text8"  # The unzipped corpus in the working directory; override with the real path.
  )
  config.model.num_layers = 12
  config.model.model_dim = 768
  config.model.num_heads = 12
  # SwiGLU at 2048 matches the parameters of a 4x (3072) GELU MLP.
  config.model.mlp_dim = 2048
  # Accelerator settings: bfloat16 compute, blocks under nn.scan, weight-matmul outputs kept
  # for the backward pass (fits a v5e-4 at batch 512: python -m md4jax.aot --topology=v5e:2x2).
  config.model.dtype = "bfloat16"
  config.model.scan_layers = True
  config.model.remat = "save_dots"
  config.diffusion.schedule = "linear"
  config.optimizer.learning_rate = 3e-4
  config.optimizer.warmup_steps = 2000
  config.optimizer.b2 = 0.999
  config.optimizer.ema_decay = 0.9999
  config.training.max_checkpoints_to_keep = 5
  config.eval.num_sequences = 2048
  config.eval.num_mc_samples = 4
  config.eval.batch_size = 256
  config.sample.num_samples = 8
  config.sample.num_steps = 256
  if variant in ("cpu", "cpu_bd3"):
    # Tuned to learn in under 20 minutes of wall time on 2 CPU cores, with the model defaults
    # and an evaluation trimmed to what a CPU can afford; the measurements behind every choice
    # here are in docs/performance.md ("text8 on 2 CPU cores").
    # Two cores: small steps. 32 x 128 characters per step: the same characters as 16 x 256
    # with half the attention (a word needs no longer context).
    config.batch_size = 32
    config.data.seq_len = 128
    # In these minutes data beats width: a narrow model that sees more characters ends lower.
    config.num_train_steps = 5000
    # A device per core, and freed memory reused.
    config.cpu_devices = 2
    config.reuse_freed_host_memory = True
    config.log_every_steps = 50
    config.eval_every_steps = 5000  # Once, at the end.
    config.checkpoint_every_steps = 1000
    config.model.num_layers = 4
    config.model.model_dim = 64
    config.model.num_heads = 2
    config.model.mlp_dim = 192
    config.model.dtype = "float32"  # CPUs have no fast bfloat16 matmuls.
    config.model.scan_layers = False
    config.model.remat = "none"
    config.optimizer.learning_rate = 1e-3  # A small model tolerates a higher peak rate.
    config.optimizer.warmup_steps = 200
    config.optimizer.ema_decay = 0.999
    config.training.max_checkpoints_to_keep = 3
    config.eval.num_sequences = 256
    config.eval.batch_size = 32
    config.eval.discrete_steps = ""  # Each T costs as much as the NELBO itself; skipped on a CPU.
    config.eval.profile_bins = 10  # Half the default: one forward pass per bin and sequence.
    config.sample.num_samples = 16
    # Most confident positions first, at temperature 0.7: the most real words of the settings
    # tried (docs/performance.md); the model's own law is --config.sample.method=jump
    # --config.sample.temperature=1 (ancestral with 256 steps).
    config.sample.method = "confidence"
    config.sample.temperature = 0.7
  if variant == "cpu_bd3":
    config.diffusion.block_size = 16
    config.sample.num_steps = 16  # Per block.
  return config
