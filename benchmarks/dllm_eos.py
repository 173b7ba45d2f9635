r"""How often a converted dLLM's generations end in a run of EOS (LLaDA issue #46), as one JSON line.

  python benchmarks/dllm_eos.py --model=tests/golden/llada --rows=64 --gen_length=32

Loads the folder (LLaDA or Dream; or a workdir converted from one, fine-tuned on sums) with
`md4jax.load`, samples `rows` prompts "ab+cd=" (chat-formatted with --chat) with their decoding (LLaDA: low-confidence remasking in blocks after the prompt, steps
split evenly; Dream: maskgit_plus over the canvas), and reports on the model's own
tokens: the share of rows whose output ends in a run of ≥ 2 EOS tokens ± SE, the share with an
EOS, the mean generated length up to and including the first EOS, and the network calls without
and with md4jax's EOS stop (eos_id: generation stops once every row has ended; tokens after a
row's first EOS are then padding, and count as such in lengths and scores).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import md4jax
from md4jax.data import chat

_MODEL = flags.DEFINE_string(
  "model", "tests/golden/llada", "A LLaDA or Dream folder, or a workdir converted from one."
)
_ROWS = flags.DEFINE_integer("rows", 64, "Prompts sampled.")
_GEN_LENGTH = flags.DEFINE_integer("gen_length", 32, "Tokens generated per prompt.")
_BLOCK = flags.DEFINE_integer("block_length", 8, "LLaDA's block length.")
_STEPS = flags.DEFINE_integer("steps", 32, "Network calls over the generation.")
_SEED = flags.DEFINE_integer("seed", 0, "The prompts' and samples' seed.")
_CHAT = flags.DEFINE_bool("chat", True, "Render each prompt in the model's chat template.")
_EOS = flags.DEFINE_string("eos_token", "<|endoftext|>", "The model's end-of-text token.")


def _eos_run_share(tokens: np.ndarray, eos_id: int) -> tuple:
  """(share of rows whose last two tokens are EOS, its standard error)."""
  ends = (tokens[:, -2:] == eos_id).all(1).astype(np.float64)
  return float(ends.mean()), float(ends.std(ddof=1) / np.sqrt(len(ends)))


def main(argv):
  del argv
  loaded = md4jax.load(_MODEL.value)
  config = loaded.config
  tokenizer = loaded.tokenizer
  eos_id = tokenizer.tokenizer.token_to_id(_EOS.value)
  if eos_id is None:
    raise app.UsageError(f"The tokenizer has no {_EOS.value}: give --eos_token.")
  rng = np.random.default_rng(_SEED.value)
  # Sums of two-digit numbers: one token per character, so every prompt has one width.
  texts = [f"{a}+{b}=" for a, b in rng.integers(10, 100, size=(_ROWS.value, 2))]
  if _CHAT.value:
    texts = [chat.apply(config.data.chat_template, text) for text in texts]
  prompts = [tokenizer.encode(text) for text in texts]
  width = max(len(p) for p in prompts)
  # Equal widths (the letters are one token each): no padding to reason about.
  assert all(len(p) == width for p in prompts)
  prompt = jnp.asarray(np.stack(prompts), jnp.int32)
  dream = config.model.shift_logits
  settings = dict(
    batch_size=_ROWS.value,
    length=width + _GEN_LENGTH.value,
    method="confidence",
    temperature=0.0,
    prompt=prompt,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
  )
  if dream:
    settings.update(num_steps=_STEPS.value, reveal_counts="proportional")
  else:
    blocks = _GEN_LENGTH.value // _BLOCK.value
    settings.update(
      num_steps=_STEPS.value // blocks,
      reveal_counts="even",
      block_size=_BLOCK.value,
      block_offset=width,
    )
  key = jax.random.PRNGKey(_SEED.value)
  report = {"model": config.data.tokenizer_path, "rows": _ROWS.value, "eos_id": eos_id}
  tokens, info = md4jax.sample(key, loaded.denoise_fn, **settings)
  generated = np.asarray(tokens)[:, width:]  # The model's own tokens, nothing overwritten.
  share, se = _eos_run_share(generated, eos_id)
  is_eos = generated == eos_id
  lengths = np.where(is_eos.any(1), is_eos.argmax(1) + 1, generated.shape[1])
  report.update(
    ends_in_eos_run=share,
    ends_in_eos_run_se=se,
    has_eos=float(is_eos.any(1).mean()),
    mean_length=float(lengths.mean()),
    nfe=int(info["nfe"]),
  )
  # With eos_id the decoder stops once every row has ended: the calls that saves.
  _, stopped = md4jax.sample(key, loaded.denoise_fn, eos_id=eos_id, **settings)
  report["nfe_with_eos_stop"] = int(stopped["nfe"])
  print(json.dumps(report))


if __name__ == "__main__":
  app.run(main)
