r"""Conditional MD4: a small masked diffusion model that writes responses to prompts.

  python -m md4jax.main --config=configs/conditional.py --workdir=DIR --config.data.path=PAIRS.jsonl

data.path is a .jsonl file (or a folder of them) with one record per line,
{"prompt": ..., "response": ...} (field names: data.prompt_field and
data.response_field); its last 5% of examples are held out for evaluation. Each
example is one row of data.seq_len tokens, [prompt][response][EOS] then padding:
the denoiser reads the prompt but only the response is ever masked and scored,
so the loss and the held-out NELBO are per response token. A prompt longer than
a row is an error naming its file:line; longer responses are cut (and counted).
A byte-level BPE is trained on the training prompts and responses and saved as
DIR/tokenizer.json. Afterwards, complete a prompt of your own (infilling the rest):

  python -m md4jax.main --config=configs/conditional.py --workdir=DIR \
      --config.data.path=PAIRS.jsonl --mode=sample --config.sample.prompt="..."
"""

from md4jax import config as config_lib

# The BPE vocabulary; the model's vocabulary must match it (the mask id is one past).
_BPE_VOCAB_SIZE = 1024


def get_config():
  # The localtext model, optimizer and budget (configs/localtext.py); only the data differ.
  config = config_lib.load_config("localtext")
  config.data.dataset = (
    "conditional"  # JSONL prompt/response pairs (md4jax.data.corpora.conditional).
  )
  config.data.path = ""  # Required: set --config.data.path=FILE_OR_FOLDER.
  config.data.prompt_field = "prompt"  # JSONL field of the prompt: read, never masked nor scored.
  config.data.response_field = "response"  # JSONL field of the response: the model's target.
  config.data.tokenizer = "bpe"  # Byte-level BPE trained on the training pairs; or "char", "byte".
  config.data.bpe_vocab_size = _BPE_VOCAB_SIZE  # Fewer merges than localtext: pair sets are small.
  config.data.vocab_size = 0  # The tokenizer's size (data.tokenizer=char or byte included).
  config.data.seq_len = 128  # Tokens per example, prompt included.
  return config
