r"""MD4 on your own text: a small masked diffusion model that trains on a CPU.

  python -m md4jax.main --config=configs/localtext.py --workdir=DIR --config.data.path=FILE

data.path is a .txt file (one document per non-empty line), a .jsonl file (one
document per line, in the field data.text_field), or a folder of such files; its
last 5% of documents are held out for evaluation. A byte-level BPE of
data.bpe_vocab_size ids is trained on the training documents and saved as
DIR/tokenizer.json, which a resumed run reuses. Documents are packed whole into
rows of data.seq_len tokens and attend only within themselves. For example, on
a folder of news articles:

  python -m md4jax.main --config=configs/localtext.py --workdir=/tmp/md4jax_news \
      --config.data.path=/path/to/news
"""

from md4jax import config as config_lib

# The BPE vocabulary; the model's vocabulary must match it (the mask id is one past).
_BPE_VOCAB_SIZE = 2048


def get_config():
  config = config_lib.base_config()
  config.batch_size = 32  # Rows of seq_len tokens per step.
  config.num_train_steps = 3000  # About 12M tokens: several epochs of a few-MB corpus.
  config.log_every_steps = 50  # Frequent progress lines on a slow CPU run.
  config.eval_every_steps = 500  # Held-out NELBO six times per run.
  config.checkpoint_every_steps = 500  # A killed run loses at most 500 steps.

  config.data.dataset = "localtext"  # A local text/JSONL file or folder (md4jax.data.corpora).
  config.data.path = ""  # Required: set --config.data.path=FILE_OR_FOLDER.
  config.data.text_field = "text"  # JSONL field holding each document's text.
  config.data.tokenizer = "bpe"  # Byte-level BPE trained on the training split; or "char", "byte".
  config.data.bpe_vocab_size = _BPE_VOCAB_SIZE  # BPE ids, <|endoftext|> (EOS) included.
  config.data.tokenizer_path = ""  # Or a local tokenizer.json to use instead of training one.
  config.data.vocab_size = 0  # The tokenizer's size (data.tokenizer=char or byte included).
  config.data.seq_len = 128  # Tokens per row; news-length documents span a few rows.
  config.data.packing = "documents"  # Whole documents per row, attention within a document only.
  config.data.worker_count = 0  # grain worker processes; 0 reads in the training process.

  config.model.num_layers = 4  # A few million parameters: minutes per thousand steps on a CPU.
  config.model.model_dim = 256  # Residual width.
  config.model.num_heads = 4  # Head dim 64.
  config.model.mlp_dim = 768  # SwiGLU hidden width (3x the model width).
  config.model.time_conditioning = "none"  # MD4/MDLM text models need no time input.

  config.diffusion.schedule = "linear"  # alpha(t) = 1 - t, as MD4 uses for text.

  config.optimizer.learning_rate = 1e-3  # Small model, small batch: a high peak rate.
  config.optimizer.warmup_steps = 200  # Linear warmup, then cosine decay to 0.
  config.optimizer.weight_decay = 0.01  # Light AdamW decay against overfitting a small corpus.
  config.optimizer.ema_decay = 0.999  # EMA over roughly the last thousand steps.

  config.eval.num_sequences = 256  # Held-out rows per evaluation (at most the split's rows).
  config.eval.num_mc_samples = 4  # NELBO draws per row.
  config.eval.batch_size = 32  # Rows per evaluation call.

  config.sample.num_samples = 4  # Samples printed at the end of training.
  config.sample.num_steps = 128  # One sampler step per position.
  return config
