r"""Writes the Hugging Face golden folders of tests/test_convert.py, running `transformers` itself.

  python -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install transformers torch tokenizers numpy   # setup.py's "hf" extra
  /tmp/hfvenv/bin/python tests/golden/make_hf_golden.py

md4jax's own venv needs neither torch nor transformers: the test reads only what this writes.
The files here were written with transformers 5.25.0 and torch 2.13.0 (CPU).

Two tiny random models, each saved by `save_pretrained` as a Hugging Face folder:

  hf_llama/  LlamaForCausalLM: 2 layers, hidden 64, 4 heads, 2 key/value heads, MLP 96, vocab
             96, untied embeddings, rope_theta 500000, rms_norm_eps 1e-5, stored in bfloat16.
  hf_qwen2/  Qwen2ForCausalLM: the same shape with Qwen2's q/k/v biases, tied embeddings,
             rope_theta 1e6, rms_norm_eps 1e-6, stored in float32.

Every weight is perturbed by N(0, 0.1²) noise after the default init, so the norm weights
differ from 1 and the biases from 0: a conversion that drops or misplaces one changes the
logits. The bfloat16 model's float32 weights are rounded to bfloat16 before its logits are
taken, so the logits are those of the stored weights.

Each folder also holds:
  tokenizer.json  a character-level tokenizer of the 95 printable ASCII characters and
                  <|endoftext|> (96 ids, the models' vocabulary), so a converted workdir
                  decodes text.
  logits.npz      token_ids [2, 16] int32 (fixed) and the model's causal logits [2, 16, 96]
                  float32 on them, computed in float32 on the CPU.
"""

import json
import pathlib

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models

GOLDEN = pathlib.Path(__file__).resolve().parent
VOCAB = 96
SHAPE = dict(
  vocab_size=VOCAB,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=128,
  hidden_act="silu",
)
MODELS = {
  "hf_llama": (
    transformers.LlamaConfig,
    transformers.LlamaForCausalLM,
    dict(rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    torch.bfloat16,
  ),
  "hf_qwen2": (
    transformers.Qwen2Config,
    transformers.Qwen2ForCausalLM,
    dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    torch.float32,
  ),
}
NOISE = 0.1


def char_tokenizer() -> Tokenizer:
  """Ids 0..94: the printable ASCII characters ' '..'~'; id 95: <|endoftext|>."""
  vocab = {chr(code): i for i, code in enumerate(range(32, 127))}
  vocab["<|endoftext|>"] = len(vocab)
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.add_special_tokens(["<|endoftext|>"])
  tokenizer.decoder = decoders.Fuse()  # Characters joined without spaces.
  assert tokenizer.get_vocab_size() == VOCAB
  return tokenizer


def write(name: str, token_ids: np.ndarray):
  config_class, model_class, options, dtype = MODELS[name]
  torch.manual_seed(0)
  model = model_class(config_class(**SHAPE, **options)).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(NOISE * torch.randn_like(param))
      param.copy_(param.to(dtype).to(torch.float32))  # The stored values, in float32.
    logits = model(torch.as_tensor(token_ids, dtype=torch.long)).logits.numpy()
  folder = GOLDEN / name
  model.to(dtype).save_pretrained(folder, safe_serialization=True)
  char_tokenizer().save(str(folder / "tokenizer.json"))
  np.savez(folder / "logits.npz", token_ids=token_ids, logits=logits.astype(np.float32))
  config = json.loads((folder / "config.json").read_text())
  print(f"{folder}: {config['architectures']}, logits std {logits.std():.3f}")


def main():
  token_ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16)).astype(np.int32)
  for name in MODELS:
    write(name, token_ids)


if __name__ == "__main__":
  main()
