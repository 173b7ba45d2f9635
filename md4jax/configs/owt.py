r"""MD4 / MDLM on OpenWebText: GPT-2 tokenizer, 1024 tokens, a GPT-2-small-sized denoiser
(12 layers, width 768, 12 heads), batch 512, AdamW 3e-4 with 2000 warmup steps, b2 0.999,
weight decay 0.03, EMA 0.9999, 1M steps, linear schedule, adaLN time conditioning.
`configs/owt.py:medium` is MD4's medium model: 24 layers, width 1024, 16 heads, cosine schedule.
`configs/owt.py:bd3` is BD3-LM's OpenWebText setting: the small model time-free, blocks of 16
tokens (--config.diffusion.block_size=4 for b = 4), trained in one pass over 2 x 1024 tokens
with the splash kernel (a TPU config: XLA's attention over 2048 x 2048 scores does not fit).

On a TPU pod slice (launch/README.md), one command on every host:

  python -m md4jax.main --config=configs/owt.py --workdir=/mnt/shared/owt \
      --config.data.path=/mnt/shared/openwebtext --config.data.tokenizer_path=/mnt/shared/gpt2

Check first that it fits a slice, on any CPU machine (pip install -e ".[tpu]"):

  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/owt.py --topology=v5e:4x4
  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/owt.py:medium --topology=v5p:2x2x2
  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/owt.py:bd3 --topology=v5e:4x4

data.path is a local folder of OpenWebText text/JSONL files (or "" to read the Hugging Face
dataset where a network exists); data.tokenizer_path a local GPT-2 tokenizer.json (or "" to
fetch "gpt2" from the Hub). Params, optimizer state and EMA are sharded over all chips (FSDP);
compute is bfloat16 with float32 params; blocks run under nn.scan with rematerialization.
"""

from md4jax import config as config_lib

# GPT-2's byte-level BPE: 50257 ids (EOS = 50256); the mask id is 50257.
GPT2_VOCAB_SIZE = 50257


def get_config(variant: str = ""):
  """variant "" is MD4's small OpenWebText model; "medium" its 24-layer model; "bd3" BD3-LM's."""
  if variant not in ("", "medium", "bd3"):
    raise ValueError(f"Unknown owt variant {variant!r}; valid: '' (small), 'medium', 'bd3'.")
  config = config_lib.base_config()
  config.batch_size = 512
  config.num_train_steps = 1_000_000
  config.log_every_steps = 500
  config.eval_every_steps = 10_000
  config.checkpoint_every_steps = 5_000
  config.data.dataset = "owt"
  config.data.vocab_size = GPT2_VOCAB_SIZE
  config.data.seq_len = 1024
  config.data.tokenizer = "bpe"
  config.data.worker_count = 4
  config.model.num_layers = 12
  config.model.model_dim = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 2048  # SwiGLU at 2048 has the parameters of a 4x (3072) GELU MLP.
  config.model.time_conditioning = "adaln"
  config.model.dtype = "bfloat16"
  config.model.remat = "full"
  config.model.scan_layers = True
  # Every device holds 1/N of the params, optimizer state and EMA.
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.diffusion.schedule = "linear"
  config.optimizer.learning_rate = 3e-4
  config.optimizer.warmup_steps = 2000
  config.optimizer.b2 = 0.999
  config.optimizer.weight_decay = 0.03
  config.optimizer.ema_decay = 0.9999
  config.training.max_checkpoints_to_keep = 5
  config.eval.num_sequences = 2048
  config.eval.num_mc_samples = 4
  config.eval.batch_size = 256
  config.eval.discrete_steps = "1000"
  config.sample.num_samples = 8
  config.sample.num_steps = 1000
  if variant == "medium":
    config.model.num_layers = 24
    config.model.model_dim = 1024
    config.model.num_heads = 16
    config.model.mlp_dim = 2816  # About 8/3 of the width, rounded to a multiple of 128.
    config.diffusion.schedule = "cosine"
  if variant == "bd3":
    config.model.time_conditioning = "none"  # BD3-LM's network is time-free; t is per block.
    config.model.attention = "splash"  # Skips the pattern's empty tiles.
    config.diffusion.block_size = 16
    # The standard estimator scores in one pass; mask_count and the discrete-time bound run the
    # reference path, a call per block: 64 per draw here.
    config.eval.estimator = "standard"
    config.eval.discrete_steps = ""
    config.sample.num_steps = 16  # Per block.
  return config
