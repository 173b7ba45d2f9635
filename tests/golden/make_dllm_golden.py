r"""Writes the LLaDA and Dream golden folders, running the models' and samplers' own code.

  python -m venv /tmp/dllmvenv
  /tmp/dllmvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /tmp/dllmvenv/bin/pip install transformers==4.57.0 tokenizers numpy safetensors
  nice /tmp/dllmvenv/bin/python tests/golden/make_dllm_golden.py [--peer_dir=/tmp/peer]

md4jax's own venv needs neither torch nor transformers: a test reads only what this writes.
The files here were written with torch 2.13.0 (CPU), transformers 4.57.0, tokenizers 0.22.2
and numpy 2.4.6, from the peer code at these commits:

  ZHZisZZ/dllm  ca176752fbceec49c6b4777a2c18ae88e4eb10ed  (the LLaDA and Dream models)
  ML-GSAI/LLaDA b7e6c3565f194352da44b38dd12b6970597309f3  (generate.py, get_log_likelihood.py)

transformers is 4.57.0 because dllm pins it (its pyproject.toml; PyPI marks 4.57.0 yanked for a
packaging problem, and an exact pin still installs it); the 5.x line breaks both
models (Dream's rotary init looks up a "default" rope type that 5.x removed; LLaDA's config
loses `use_cache`, which 5.x pops as a generation parameter, and its LM wrapper never calls
`post_init`, which 5.x's loader needs). The model code is imported unchanged from --peer_dir,
laid out like this (DLLM and LLADA are checkouts of the two repositories, any copy of the files
at those commits will do):

  P=/tmp/peer; mkdir -p $P/dllm_llada $P/dllm_dream
  touch $P/dllm_llada/__init__.py $P/dllm_dream/__init__.py
  for f in modeling_llada configuration_llada; do
    git -C DLLM show HEAD:dllm/pipelines/llada/models/$f.py > $P/dllm_llada/$f.py; done
  for f in modeling_dream configuration_dream generation_utils; do
    git -C DLLM show HEAD:dllm/pipelines/dream/models/$f.py > $P/dllm_dream/$f.py; done
  for f in generate get_log_likelihood; do git -C LLADA show HEAD:$f.py > $P/$f.py; done

(The packages' __init__.py are empty, not dllm's, which would import LLaDA-MoE too; the
model files import their siblings relatively, so they must sit in a package.) One runtime
shim, `cpu_init_device`: LLaDAModelLM builds its network with init_device "cuda" hard-coded,
which fails on a CPU-only torch; the shim turns that "cuda" into "cpu" when CUDA is absent.
Nothing else of the peer code is touched.

Two tiny random models, each perturbed by N(0, 0.1²) noise after its own init (so the norm
weights differ from 1 and Dream's q/k/v biases from 0), saved by `save_pretrained`
(safetensors) and loaded back by their own classes; every golden output below is computed
by the reloaded model, whose logits are checked to equal the in-memory model's:

  llada/  LLaDAModelLM (dllm's modeling_llada): llama blocks, d_model 64, 4 heads, 4 key/value
          heads (as LLaDA-8B), 2 layers, MLP 96, vocab 128, untied, rope_theta 500000,
          rms_norm_eps 1e-5, mask_token_id 126, eos/pad 125, dropouts 0 (as LLaDA-8B),
          stored in float32. The init is LLaDA's own (`reset_parameters`: init_fn "normal",
          std 0.02).
  dream/  DreamModel (dllm's modeling_dream, with its DreamGenerationMixin): hidden 64, 4 heads,
          2 key/value heads, 2 layers, MLP 96, vocab 128, untied, q/k/v biases,
          rope_theta 1e6, rms_norm_eps 1e-6, mask_token_id 126, bos/eos/pad 125, stored in
          bfloat16. Its float32 weights are rounded to bfloat16 before anything is computed,
          and every golden output is computed from those values in float32. Its
          generation_config.json is a DreamGenerationConfig (Dream's own loader reads one).

Each folder also holds:
  tokenizer.json         character-level: ids 0..94 the printable ASCII characters ' '..'~',
                         id 95 "\n" (an ordinary token, so that the chat templates' newlines
                         encode), ids 96..127 special tokens (SPECIALS below: for LLaDA
                         <|startoftext|> 96, <|start_header_id|> 97, <|end_header_id|> 98,
                         <|eot_id|> 99, <|endoftext|> 125, <|mdm_mask|> 126; for Dream
                         <|im_start|> 96, <|im_end|> 97, <|endoftext|> 125, <|mask|> 126; the
                         other ids are <|reserved_special_token_K|>). Characters outside the
                         vocabulary are dropped on encoding.
  tokenizer_config.json  PreTrainedTokenizerFast with bos/eos/pad/mask tokens and a Jinja
                         chat_template; one user turn with add_generation_prompt renders as
                         LLaDA: <|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>
                                <|start_header_id|>assistant<|end_header_id|>\n\n
                         Dream: <|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n
                         (the real templates add what these leave out: LLaDA's a leading
                         <|startoftext|>, Qwen's a default system turn).
  logits.npz             token_ids [2, 16] int32 (fixed: printable characters with mask ids
                         and some special ids among them) and logits [2, 16, 128] float32,
                         the model's raw forward output on them (`model(token_ids).logits`,
                         unshifted, no attention mask), on the CPU in float32.

One difference is removed before sampling: md4jax never predicts the mask id, and the raw
networks here can. LLaDA's `generate` therefore runs on `MaskSuppressed`, a thin module whose
forward returns the model's logits with the mask id's column set to the lowest float32
(-3.4e38, not -inf: generate's CFG forms un + (s + 1)(cond - un), which -inf turns into NaN;
the softmax of either is exactly 0 there, and the runs without CFG are checked to give the same
tokens with -inf). Dream's `diffusion_generate` gets the same -inf column through its own
`generation_logits_hook_func`.

How near the sampling runs come to ties, measured when these files were written: the smallest gap
between a chosen and the best unchosen confidence (probability, margin or negative entropy) is
5e-6 (dream c3, between two probabilities), every other gap 1e-5 or more, and every argmax wins by
1e-4 of a logit or more.

llada/generate.npz: LLaDA's `generate` (temperature 0, remasking "low_confidence",
logits_eos_inf and confidence_eos_eot_inf off) on MaskSuppressed, one case per prefix cK_:
  cK_prompt [2, P] int32 (two different rows of printable characters, no mask id),
  cK_attention_mask [2, P] int32 (all ones: generate binds the mask CFG needs only when one is
  given, and an all-ones mask is the same as none for the model), cK_steps, cK_gen_length,
  cK_block_length (int32 scalars), cK_cfg_scale, cK_temperature (float32 scalars),
  cK_remasking (a str scalar), cK_output [2, P + gen_length] int32.
    c0: P 8, gen_length 16, block_length 16, steps 16
    c1: P 8 (c0's prompt), gen_length 16, block_length 4, steps 8 (semi-AR, 2 steps a block)
    c2: P 7, gen_length 12, block_length 4, steps 6 (the prompt not a multiple of a block)
    c3: P 8, cfg_scale 1.0, gen_length 8, block_length 8, steps 4
    c4: P 8, gen_length 10, block_length 10, steps 4 (10 masks over 4 steps: 3, 3, 2, 2)
  c0_output_raw [2, 24] int32: c0 on the unwrapped model, whose argmax may pick the mask id;
  c0_raw_differs: bool scalar, whether it differs from c0_output. mask_id: int32 scalar, 126.

dream/generate.npz: DreamModel.diffusion_generate with a DreamGenerationConfig (temperature 0,
alg_temp None, eps 1e-3, no attention mask, return_dict False) and the -inf hook, one case per
prefix cK_: cK_prompt [2, 8] int32 (two different rows, no mask or pad id), cK_alg (a str
scalar), cK_steps, cK_max_new_tokens (int32 scalars), cK_temperature, cK_alg_temp, cK_eps,
cK_top_p (float32 scalars; top_p 1.0 means off, as Dream treats any top_p >= 1),
cK_output [2, 24] int32.
    c0..c5: alg maskgit_plus, topk_margin, entropy with steps 16, then the same with steps 5;
    c6: alg entropy, steps 16, top_p 0.9. max_new_tokens is 16 throughout.
  mask_id: int32 scalar, 126.

llada/likelihood.npz: LLaDA's `get_log_likelihood` (mc_num 8, batch_size 4, cfg_scale 0) and the
draws of its `forward_process` that it makes, under torch.manual_seed(LIKELIHOOD_SEED):
  prompt [6] int32, answer [10] int32, seed, mc_num, batch_size (int32 scalars),
  masks [8, 16] bool (the masked positions of each draw, prompt positions never; draws 0..3 are
  the first batch), p_mask [8] float32 (each draw's mask ratio, masked answer tokens / 10),
  losses [2] float32 (each batch's `loss.item()`: sum over its draws and masked positions of
  cross-entropy / p_mask, divided by batch_size) and log_likelihood (float32 scalar,
  get_log_likelihood's return, -mean(losses)), all on MaskSuppressed; losses_raw [2] and
  log_likelihood_raw the same on the unwrapped model (the draws do not depend on the model).
  The masks are read by running forward_process exactly as get_log_likelihood does under the
  same seed; the losses recomputed in NumPy (float64) from the stored masks and the model's
  logits are checked to equal both `losses` and the return value to a relative 1e-6 (the losses
  are about 60, where float32's spacing is 4e-6), and the return value to equal -mean(losses).
"""

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import sys
import types

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models

GOLDEN = pathlib.Path(__file__).resolve().parent
VOCAB = 128
MASK = 126
EOS = 125
NOISE = 0.1
SEED = 0
LIKELIHOOD_SEED = 1234
NEWLINE_ID = 95

LLADA_CONFIG = dict(
  block_type="llama",
  d_model=64,
  n_heads=4,
  n_kv_heads=4,
  n_layers=2,
  mlp_hidden_size=96,
  vocab_size=VOCAB,
  embedding_size=VOCAB,
  rope=True,
  rope_theta=500000.0,
  rms_norm_eps=1e-5,
  layer_norm_type="rms",
  activation_type="silu",
  include_bias=False,
  weight_tying=False,
  max_sequence_length=128,
  mask_token_id=MASK,
  eos_token_id=EOS,
  pad_token_id=EOS,
  input_emb_norm=False,
  scale_logits=False,
  attention_layer_norm=False,
  alibi=False,
  flash_attention=False,
  attention_dropout=0.0,  # LLaDA-8B's; the defaults are 0.1 (inert in eval mode either way).
  embedding_dropout=0.0,
  residual_dropout=0.0,
)
DREAM_CONFIG = dict(
  vocab_size=VOCAB,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  rope_theta=1e6,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  max_position_embeddings=128,
  mask_token_id=MASK,
  pad_token_id=EOS,
  bos_token_id=EOS,
  eos_token_id=EOS,
)


def reserved(ids):
  return {i: f"<|reserved_special_token_{k}|>" for k, i in enumerate(ids)}


SPECIALS = {
  "llada": {
    96: "<|startoftext|>",
    97: "<|start_header_id|>",
    98: "<|end_header_id|>",
    99: "<|eot_id|>",
    **reserved([*range(100, 125), 127]),
    125: "<|endoftext|>",
    126: "<|mdm_mask|>",
  },
  "dream": {
    96: "<|im_start|>",
    97: "<|im_end|>",
    **reserved([*range(98, 125), 127]),
    125: "<|endoftext|>",
    126: "<|mask|>",
  },
}
TOKENIZER_CONFIG = {
  "llada": dict(
    bos_token="<|startoftext|>",
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    mask_token="<|mdm_mask|>",
    chat_template=(
      "{% for message in messages %}"
      "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
      " + message['content'] + '<|eot_id|>' }}"
      "{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
  ),
  "dream": dict(
    bos_token="<|endoftext|>",
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    mask_token="<|mask|>",
    chat_template=(
      "{% for message in messages %}"
      "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
      "{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
  ),
}
RENDERED = {  # One user turn "Hi!" with add_generation_prompt, checked against the template.
  "llada": "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
  "<|start_header_id|>assistant<|end_header_id|>\n\n",
  "dream": "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
}

# Prompts as text (every character is one token).
PROMPT8 = ["The cat ", "1+2=3; x"]
PROMPT7 = ["Hello, ", "[a-z]*?"]
LIKELIHOOD_PROMPT = "Q: 2+2"
LIKELIHOOD_ANSWER = " A: 4. Ok!"
LLADA_CASES = [
  dict(prompt=PROMPT8, gen_length=16, block_length=16, steps=16, cfg_scale=0.0),
  dict(prompt=PROMPT8, gen_length=16, block_length=4, steps=8, cfg_scale=0.0),
  dict(prompt=PROMPT7, gen_length=12, block_length=4, steps=6, cfg_scale=0.0),
  dict(prompt=PROMPT8, gen_length=8, block_length=8, steps=4, cfg_scale=1.0),
  dict(prompt=PROMPT8, gen_length=10, block_length=10, steps=4, cfg_scale=0.0),
]
DREAM_PROMPT = ["def f(x)", "Once, a "]
DREAM_CASES = [
  *[dict(alg=alg, steps=16, top_p=1.0) for alg in ("maskgit_plus", "topk_margin", "entropy")],
  *[dict(alg=alg, steps=5, top_p=1.0) for alg in ("maskgit_plus", "topk_margin", "entropy")],
  dict(alg="entropy", steps=16, top_p=0.9),
]
DREAM_NEW_TOKENS = 16
DREAM_EPS = 1e-3


def load_module(name: str, path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def import_peer(peer_dir: pathlib.Path) -> types.SimpleNamespace:
  sys.path.insert(0, str(peer_dir))
  return types.SimpleNamespace(
    llada=importlib.import_module("dllm_llada.modeling_llada"),
    llada_config=importlib.import_module("dllm_llada.configuration_llada"),
    dream=importlib.import_module("dllm_dream.modeling_dream"),
    dream_config=importlib.import_module("dllm_dream.configuration_dream"),
    dream_generation=importlib.import_module("dllm_dream.generation_utils"),
    generate=load_module("llada_generate", peer_dir / "generate.py"),
    likelihood=load_module("llada_get_log_likelihood", peer_dir / "get_log_likelihood.py"),
  )


def cpu_init_device(modeling_llada):
  """LLaDAModelLM sets its network's init_device to "cuda"; on a CPU-only torch, use "cpu"."""
  if torch.cuda.is_available():
    return

  class ModelConfig(modeling_llada.ModelConfig):
    def __setattr__(self, key, value):
      super().__setattr__(key, "cpu" if (key, value) == ("init_device", "cuda") else value)

  def create(config):
    return ModelConfig(
      **{f.name: getattr(config, f.name) for f in dataclasses.fields(modeling_llada.ModelConfig)}
    )

  modeling_llada.create_model_config_from_pretrained_config = create


class MaskSuppressed(torch.nn.Module):
  """The model with the mask id's logit column set to `fill` (what md4jax's networks give)."""

  def __init__(self, model, mask_id: int, fill: float):
    super().__init__()
    self.model, self.mask_id, self.fill = model, mask_id, fill

  @property
  def device(self):
    return self.model.device

  def forward(self, input_ids, attention_mask=None):
    logits = self.model(input_ids, attention_mask=attention_mask).logits.clone()
    logits[..., self.mask_id] = self.fill
    return types.SimpleNamespace(logits=logits)


def perturb(model, dtype):
  with torch.no_grad():
    for param in model.parameters():
      param.add_(NOISE * torch.randn_like(param))
      param.copy_(param.to(dtype).to(torch.float32))  # The stored values, in float32.


def encode(texts) -> np.ndarray:
  ids = [[ord(c) - 32 for c in text] for text in texts]
  assert all(0 <= i < 95 for row in ids for i in row), texts
  return np.asarray(ids, dtype=np.int32)


def char_tokenizer(name: str) -> Tokenizer:
  vocab = {chr(code): i for i, code in enumerate(range(32, 127))}
  vocab["\n"] = NEWLINE_ID
  specials = SPECIALS[name]
  assert sorted(specials) == list(range(NEWLINE_ID + 1, VOCAB))
  vocab.update({token: i for i, token in specials.items()})
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.add_special_tokens([specials[i] for i in sorted(specials)])
  tokenizer.decoder = decoders.Fuse()  # Characters joined without spaces.
  assert tokenizer.get_vocab_size() == VOCAB
  return tokenizer


def write_tokenizer(name: str, folder: pathlib.Path):
  char_tokenizer(name).save(str(folder / "tokenizer.json"))
  config = dict(
    tokenizer_class="PreTrainedTokenizerFast",
    model_max_length=128,
    clean_up_tokenization_spaces=False,
    **TOKENIZER_CONFIG[name],
  )
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  text = tokenizer.apply_chat_template(
    [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
  )
  assert text == RENDERED[name], repr(text)
  ids = tokenizer(text, add_special_tokens=False)["input_ids"]
  assert tokenizer.decode(ids) == text and NEWLINE_ID in ids
  assert tokenizer.mask_token_id == MASK and tokenizer.eos_token_id == EOS
  assert tokenizer.pad_token_id == EOS
  assert tokenizer("Hi!")["input_ids"] == encode(["Hi!"])[0].tolist()


def fixed_token_ids() -> np.ndarray:
  ids = np.random.default_rng(0).integers(0, 95, size=(2, 16)).astype(np.int32)
  ids[0, [3, 4, 10]] = MASK
  ids[1, [0, 7, 8, 15]] = MASK
  ids[0, 0], ids[0, 15], ids[1, 5] = 96, EOS, 97
  ids[1, 11] = 127
  return ids


def forward_logits(model, token_ids) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(token_ids, dtype=torch.long)).logits.float().numpy()


def save_logits(folder, model, reloaded):
  token_ids = fixed_token_ids()
  logits = forward_logits(reloaded, token_ids)
  np.testing.assert_array_equal(logits, forward_logits(model, token_ids))
  np.savez(folder / "logits.npz", token_ids=token_ids, logits=logits.astype(np.float32))
  return logits


def llada_generate(peer, model, case, fill):
  prompt = torch.as_tensor(encode(case["prompt"]), dtype=torch.long)
  net = model if fill is None else MaskSuppressed(model, MASK, fill)
  out = peer.generate.generate(
    net,
    prompt,
    attention_mask=torch.ones_like(prompt),
    steps=case["steps"],
    gen_length=case["gen_length"],
    block_length=case["block_length"],
    temperature=0.0,
    cfg_scale=case["cfg_scale"],
    remasking="low_confidence",
    mask_id=MASK,
  )
  assert fill is None or not (out == MASK).any()
  return out.numpy().astype(np.int32)


def write_llada(peer):
  cpu_init_device(peer.llada)
  torch.manual_seed(SEED)
  config = peer.llada_config.LLaDAConfig(**LLADA_CONFIG)
  model = peer.llada.LLaDAModelLM(config).eval()
  model.model.reset_parameters()
  perturb(model, torch.float32)
  folder = GOLDEN / "llada"
  model.save_pretrained(folder, safe_serialization=True)
  write_tokenizer("llada", folder)
  reloaded = peer.llada.LLaDAModelLM.from_pretrained(folder, dtype=torch.float32).eval()
  logits = save_logits(folder, model, reloaded)

  low = torch.finfo(torch.float32).min
  arrays = dict(mask_id=np.int32(MASK))
  for k, case in enumerate(LLADA_CASES):
    output = llada_generate(peer, reloaded, case, low)
    if case["cfg_scale"] == 0:
      np.testing.assert_array_equal(output, llada_generate(peer, reloaded, case, -np.inf))
    prompt = encode(case["prompt"])
    arrays.update(
      {
        f"c{k}_prompt": prompt,
        f"c{k}_attention_mask": np.ones_like(prompt),
        f"c{k}_steps": np.int32(case["steps"]),
        f"c{k}_gen_length": np.int32(case["gen_length"]),
        f"c{k}_block_length": np.int32(case["block_length"]),
        f"c{k}_cfg_scale": np.float32(case["cfg_scale"]),
        f"c{k}_temperature": np.float32(0.0),
        f"c{k}_remasking": np.array("low_confidence"),
        f"c{k}_output": output,
      }
    )
  raw = llada_generate(peer, reloaded, LLADA_CASES[0], None)
  arrays["c0_output_raw"] = raw
  arrays["c0_raw_differs"] = np.bool_((raw != arrays["c0_output"]).any())
  np.savez(folder / "generate.npz", **arrays)

  likelihood = llada_likelihood(peer, reloaded)
  np.savez(folder / "likelihood.npz", **likelihood)
  return folder, logits, arrays, likelihood


def llada_likelihood(peer, model):
  prompt = torch.as_tensor(encode([LIKELIHOOD_PROMPT])[0], dtype=torch.long)
  answer = torch.as_tensor(encode([LIKELIHOOD_ANSWER])[0], dtype=torch.long)
  assert len(prompt) == 6 and len(answer) == 10
  mc_num, batch_size = 8, 4
  seq = torch.cat([prompt, answer])[None].repeat(batch_size, 1)
  prompt_index = torch.arange(seq.shape[1]) < len(prompt)

  # The draws get_log_likelihood makes under this seed: its loop, with the masks kept.
  torch.manual_seed(LIKELIHOOD_SEED)
  masks, p_masks = [], []
  for _ in range(mc_num // batch_size):
    perturbed, p_mask = peer.likelihood.forward_process(seq, prompt_index, MASK)
    masks.append(perturbed == MASK)
    p_masks.append(p_mask[:, 0])
  masks = torch.cat(masks).numpy()
  p_mask = torch.cat(p_masks).float().numpy()
  assert not masks[:, : len(prompt)].any()
  np.testing.assert_array_equal(p_mask, (masks.sum(1) / len(answer)).astype(np.float32))

  tokens = seq[0].numpy()
  noisy = np.where(masks, MASK, tokens[None])
  result = dict(
    prompt=prompt.numpy().astype(np.int32),
    answer=answer.numpy().astype(np.int32),
    seed=np.int32(LIKELIHOOD_SEED),
    mc_num=np.int32(mc_num),
    batch_size=np.int32(batch_size),
    masks=masks,
    p_mask=p_mask.astype(np.float32),
  )
  low = torch.finfo(torch.float32).min
  for suffix, net in (("", MaskSuppressed(model, MASK, low)), ("_raw", model)):
    # LLaDA's own losses, batch by batch, under the same seed.
    torch.manual_seed(LIKELIHOOD_SEED)
    losses = []
    for b in range(mc_num // batch_size):
      perturbed, p_mask_b = peer.likelihood.forward_process(seq, prompt_index, MASK)
      np.testing.assert_array_equal(perturbed.numpy(), noisy[b * batch_size : (b + 1) * batch_size])
      index = perturbed == MASK
      with torch.no_grad():
        logits = peer.likelihood.get_logits(net, perturbed, prompt_index, 0.0, MASK)
      loss = torch.nn.functional.cross_entropy(logits[index], seq[index], reduction="none")
      losses.append((loss / p_mask_b[index]).sum().item() / batch_size)
    torch.manual_seed(LIKELIHOOD_SEED)
    log_likelihood = peer.likelihood.get_log_likelihood(
      net, prompt, answer, mc_num=mc_num, batch_size=batch_size, cfg_scale=0.0, mask_id=MASK
    )
    np.testing.assert_allclose(log_likelihood, -np.mean(losses), rtol=0, atol=1e-6)

    # The same from the stored masks alone, in NumPy.
    with torch.no_grad():
      logits = net(torch.as_tensor(noisy, dtype=torch.long)).logits.double().numpy()
    logits = np.maximum(logits, -1e30)  # The lowest float32 column: exp underflows to 0 either way.
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    targets = np.broadcast_to(tokens, masks.shape)[..., None]
    nll = -np.take_along_axis(log_probs, targets, -1)[..., 0]
    per_draw = (nll * masks).sum(1) / (masks.sum(1) / len(answer))
    recomputed = per_draw.reshape(-1, batch_size).sum(1) / batch_size
    np.testing.assert_allclose(recomputed, losses, rtol=1e-6, atol=0)
    np.testing.assert_allclose(-recomputed.mean(), log_likelihood, rtol=1e-6, atol=0)
    result[f"losses{suffix}"] = np.asarray(losses, dtype=np.float32)
    result[f"log_likelihood{suffix}"] = np.float32(log_likelihood)
  return result


def write_dream(peer):
  torch.manual_seed(SEED)
  config = peer.dream_config.DreamConfig(**DREAM_CONFIG)
  model = peer.dream.DreamModel(config).eval()
  perturb(model, torch.bfloat16)
  folder = GOLDEN / "dream"
  generation_config = peer.dream_generation.DreamGenerationConfig(
    mask_token_id=MASK, pad_token_id=EOS, bos_token_id=EOS, eos_token_id=EOS
  )
  model.generation_config = generation_config
  # A copy is cast: casting the model itself would round its rotary inv_freq buffer too.
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
  write_tokenizer("dream", folder)
  reloaded = peer.dream.DreamModel.from_pretrained(folder, dtype=torch.float32).eval()
  assert isinstance(reloaded.generation_config, peer.dream_generation.DreamGenerationConfig)
  assert reloaded.generation_config.mask_token_id == MASK
  logits = save_logits(folder, model, reloaded)

  def suppress_mask(step, x, logits):
    logits[..., MASK] = -torch.inf
    return logits

  prompt = encode(DREAM_PROMPT)
  arrays = dict(mask_id=np.int32(MASK))
  for k, case in enumerate(DREAM_CASES):
    config = peer.dream_generation.DreamGenerationConfig(
      mask_token_id=MASK,
      pad_token_id=EOS,
      bos_token_id=EOS,
      eos_token_id=EOS,
      max_new_tokens=DREAM_NEW_TOKENS,
      steps=case["steps"],
      eps=DREAM_EPS,
      alg=case["alg"],
      alg_temp=None,
      temperature=0.0,
      top_p=case["top_p"],
      top_k=None,
      return_dict=False,
    )
    output = (
      reloaded.diffusion_generate(
        torch.as_tensor(prompt, dtype=torch.long),
        generation_config=config,
        generation_logits_hook_func=suppress_mask,
      )
      .numpy()
      .astype(np.int32)
    )
    assert output.shape == (2, 8 + DREAM_NEW_TOKENS) and not (output == MASK).any()
    np.testing.assert_array_equal(output[:, :8], prompt)
    arrays.update(
      {
        f"c{k}_prompt": prompt,
        f"c{k}_alg": np.array(case["alg"]),
        f"c{k}_steps": np.int32(case["steps"]),
        f"c{k}_max_new_tokens": np.int32(DREAM_NEW_TOKENS),
        f"c{k}_temperature": np.float32(0.0),
        f"c{k}_alg_temp": np.float32(0.0),
        f"c{k}_eps": np.float32(DREAM_EPS),
        f"c{k}_top_p": np.float32(case["top_p"]),
        f"c{k}_output": output,
      }
    )
  np.savez(folder / "generate.npz", **arrays)
  return folder, logits, arrays


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--peer_dir", default="/tmp/peer", type=pathlib.Path)
  args = parser.parse_args()
  if int(transformers.__version__.split(".")[0]) >= 5:
    raise SystemExit(f"transformers {transformers.__version__}: the peer code needs 4.x (4.57.0)")
  peer = import_peer(args.peer_dir.resolve())
  print(f"torch {torch.__version__}, transformers {transformers.__version__}")

  folder, logits, arrays, likelihood = write_llada(peer)
  print(f"{folder}: reloaded by LLaDAModelLM, same logits; logits std {logits.std():.3f}")
  for k in range(len(LLADA_CASES)):
    print(f"  c{k} {arrays[f'c{k}_output'][:, len(arrays[f'c{k}_prompt'][0]) :].tolist()}")
  print(f"  c0 raw differs: {bool(arrays['c0_raw_differs'])}")
  print(
    f"  log_likelihood {likelihood['log_likelihood']:.6f} (raw "
    f"{likelihood['log_likelihood_raw']:.6f}), p_mask {likelihood['p_mask'].tolist()}"
  )
  folder, logits, arrays = write_dream(peer)
  print(f"{folder}: reloaded by DreamModel, same logits; logits std {logits.std():.3f}")
  for k in range(len(DREAM_CASES)):
    print(f"  c{k} {arrays[f'c{k}_output'][:, 8:].tolist()}")
  for name in ("llada", "dream"):
    sizes = {p.name: p.stat().st_size for p in sorted((GOLDEN / name).iterdir())}
    print(f"{name}: {sizes}, total {sum(sizes.values())}")


if __name__ == "__main__":
  main()
