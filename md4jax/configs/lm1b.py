r"""MDLM on LM1B: BERT-base-uncased tokenizer, 128 tokens, 12 layers, width 768, 12 heads,
batch 512, AdamW 3e-4 with 2500 warmup steps, b2 0.999, EMA 0.9999, 1M steps, log-linear schedule.

  python -m md4jax.main --config=configs/lm1b.py --workdir=/mnt/shared/lm1b \
      --config.data.path=/mnt/shared/lm1b --config.data.tokenizer_path=/mnt/shared/bert-base-uncased

data.path is a local folder of LM1B text/JSONL files (or "" for tfds 'lm1b' where a network
exists); data.tokenizer_path a local bert-base-uncased tokenizer.json (or "" to fetch it from
the Hub). Check that it fits a TPU slice on any CPU machine (pip install -e ".[tpu]"):

  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/lm1b.py --topology=v5e:2x2
"""

from md4jax import config as config_lib

# bert-base-uncased's WordPiece vocabulary; the mask id is 30522.
BERT_VOCAB_SIZE = 30522


def get_config():
  config = config_lib.base_config()
  config.batch_size = 512
  config.num_train_steps = 1_000_000
  config.log_every_steps = 500
  config.eval_every_steps = 10_000
  config.checkpoint_every_steps = 5_000
  config.data.dataset = "lm1b"
  config.data.vocab_size = BERT_VOCAB_SIZE
  config.data.seq_len = 128
  config.data.tokenizer = "bpe"
  config.data.packing = "documents"  # LM1B is sentences: pack them, each attending to itself.
  config.data.worker_count = 4
  config.model.num_layers = 12
  config.model.model_dim = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 2048
  config.model.time_conditioning = "adaln"
  config.model.dtype = "bfloat16"
  config.model.scan_layers = True
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.diffusion.schedule = "loglinear"
  config.optimizer.learning_rate = 3e-4
  config.optimizer.warmup_steps = 2500
  config.optimizer.b2 = 0.999
  config.optimizer.ema_decay = 0.9999
  config.training.max_checkpoints_to_keep = 5
  config.eval.num_sequences = 4096
  config.eval.num_mc_samples = 4
  config.eval.batch_size = 512
  config.sample.num_samples = 8
  config.sample.num_steps = 1000
  return config
