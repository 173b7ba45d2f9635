"""The config structure shared by every `configs/*.py`; its validation is re-exported.

`base_config()` declares every key once, with what it means; a config file
overrides values only. `validate_config` (md4jax.config_validation) holds all
checks, so a bad value fails before any compilation, with a message naming the key.

model.preset names a set of model keys and their values ("md4": MD4's text
network, docs/md4_parity.md). `resolve_preset` sets them when a run starts (every
mode, and the CLI with its --config overrides), so the run's config.json holds
the resolved values. A preset owns its keys: each must be left at its
base_config value or already hold the preset's value; any other value, or a
command-line override of one to anything else, is an error naming the key. To
vary one of them, set model.preset = "none" and every key of `preset_values`.
(A config file that sets one to its base value cannot be told from one that left
it: the preset's value wins there.)
"""

import functools
import importlib.util
import json
import pathlib
from typing import Iterable

import ml_collections

from md4jax.config_validation import validate_config  # noqa: F401 (re-exported)
from md4jax.config_values import (  # noqa: F401 (md4_mlp_dim, parse_*: re-exported)
  check,
  key_value,
  md4_mlp_dim,
  parse_likelihood,
  parse_list,
  preset_values,
)
from md4jax.diffusion import schedules


def base_config() -> ml_collections.ConfigDict:
  """Every key the trainer reads, with neutral values; configs override them."""
  # One key a line, its meaning in the trailing comment (docs/configuration.md reads them).
  # fmt: off
  config = ml_collections.ConfigDict()
  config.seed = 0  # Seeds the params, the per-step RNG and the training data order.
  config.batch_size = 64  # Global batch (sequences per step), split over all devices.
  config.num_train_steps = 1000  # Optimizer steps of the whole run (a resumed run continues to it).
  config.log_every_steps = 100  # Steps between metrics.jsonl records and progress lines.
  config.eval_every_steps = 1000  # Steps between evaluations, each the headline bound only (the other bounds, discrete-T table and profile: the final one, after the last step).
  config.checkpoint_every_steps = 500  # Steps between checkpoints; the last step always saves.
  # Faster CPU steps for memory: the heap grows by a few temporaries' worth first; see
  # md4jax.runtime.allocator (figures: docs/performance.md, "Host memory").
  config.reuse_freed_host_memory = False  # CPU, glibc: one malloc arena that never unmaps, so temporaries reuse pages.
  # A small model's step is hundreds of small ops that 2 cores share poorly; a device per core
  # runs its half of the batch whole (figures: docs/performance.md, "CPU devices").
  config.cpu_devices = 0  # CPU runs: JAX devices the host is split into, for data parallelism over its cores; 0 = one.

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "markov"  # "markov" (generated, exact entropy), "text8", "localtext", "conditional" (JSONL pairs), "lm1b" or "owt".
  config.data.vocab_size = 32  # Clean token ids [0, vocab_size); the mask id is vocab_size. Text: the tokenizer's size.
  config.data.seq_len = 64  # Tokens per training and evaluation sequence.
  config.data.language_seed = 0  # markov: seeds the transition matrix and the evaluation sequences.
  config.data.concentration = 0.3  # markov: Dirichlet concentration of transition rows (small = predictable).
  config.data.path = ""  # Text datasets: a local file or folder (text8: text8/text8.zip, split 90/5/5).
  config.data.tokenizer = "char"  # localtext, conditional: "char" (data's alphabet + EOS), "byte" (256 + EOS) or "bpe".
  config.data.bpe_vocab_size = 4096  # "bpe": ids of the BPE trained on the training split (EOS included).
  config.data.tokenizer_path = ""  # A local tokenizer.json instead (lm1b/owt: BERT/GPT-2's); "" trains or fetches one.
  config.data.packing = "concat"  # Text rows: "concat" (random windows of the token stream) or "documents"; conditional: one example per row.
  config.data.text_field = "text"  # JSONL files: the field holding each document's text.
  config.data.prompt_field = "prompt"  # conditional: the JSONL field of the prompt (read, never masked nor scored).
  config.data.response_field = "response"  # conditional: the JSONL field of the response (the model's target).
  config.data.worker_count = 0  # grain worker processes for text batches; 0 reads in the training process.

  config.model = ml_collections.ConfigDict()
  config.model.type = "mdm"  # "mdm": bidirectional masked-diffusion denoiser; "ar": causal next-token baseline.
  config.model.num_layers = 2  # Transformer blocks.
  config.model.model_dim = 64  # Residual stream width.
  config.model.num_heads = 4  # Attention heads; model_dim / num_heads must be even (RoPE).
  config.model.mlp_dim = 256  # Hidden width of the SwiGLU MLP.
  config.model.time_conditioning = "none"  # "none" (time-free denoiser) or "adaln" (adaLN-Zero on alpha(t)); "ar" needs "none".
  config.model.dtype = "float32"  # Compute dtype, "float32" or "bfloat16"; params and optimizer state are always float32.
  config.model.attention = "xla"  # "xla" (any platform), "cudnn" (GPU flash attention, bfloat16) or "splash" (TPU Pallas kernel).
  config.model.remat = "none"  # Recompute block activations in the backward pass: "none", "full" or "save_dots" (keeps weight-matmul outputs).
  config.model.scan_layers = False  # Run the blocks under nn.scan (params stacked per layer): compile time flat in depth.
  config.model.norm = "rms"  # "rms" (RMSNorm, learned scale) or "layer" (LayerNorm without scale or bias, as MD4).
  config.model.mlp = "swiglu"  # MLP gate: "swiglu" (silu) or "sigmoid_glu" (sigmoid, as MD4).
  config.model.embed_dim = 0  # Token embedding width projected to model_dim (MD4: 64); 0 = model_dim, no projection.
  config.model.output_init = "normal"  # Init of the logits layer: "normal" (as model.weight_init's other matrices) or "zeros" (as MD4; pair it with a fan_in weight_init: after normal's it stays at the unigram, docs/md4_parity.md).
  config.model.weight_init = "normal"  # "normal" (std 0.02, residual-stream outputs 0.02/√(2N)), "fan_in" (truncated normal, variance 1/fan_in) or "fan_in_mlp_depth" (MD4: the MLP's at (2/N)/fan_in).
  config.model.norm_eps = 1e-6  # Epsilon of every norm (MD4: 1e-5).
  config.model.biases = False  # Biases on the embedding projection, the time MLP and the adaLN projections (MD4); never on attention (see qkv_bias), MLP or logits.
  config.model.num_kv_heads = 0  # Key and value heads (grouped-query attention, Llama's and Qwen2's), each read by num_heads / num_kv_heads query heads; 0 = num_heads.
  config.model.qkv_bias = False  # A bias on the attention's query, key and value projections (Qwen2's).
  config.model.tie_embeddings = False  # Logits read off the token embedding's first vocab_size rows (the mask row is an input only) instead of a logits layer of their own (tie_word_embeddings); needs embed_dim = 0.
  config.model.rope_base = 10000.0  # RoPE's θ: a head's pair i turns by rope_base^(-2i/head_dim) per position (Llama 3: 500000, Qwen2: 1000000).
  config.model.shifted_prediction = False  # mdm: Dream's shift, the network reads [BOS = mask id, z_0, ..., z_{L-2}] so position i's output predicts token i from the positions before it, as an ar model's next-token head does (adapting one: docs/adapt.md).
  config.model.time_input = "alpha"  # adaln: the denoiser's time input, "alpha" (α(t)) or "t" (MD4; the samplers pass t = the schedule's inverse of α).
  config.model.time_features = "dit"  # adaln: sinusoidal time features, "dit" ([cos, sin], 10000^(-i/half)) or "ddpm" ([sin, cos], 10000^(-i/(half-1)), MD4).
  config.model.time_dim = 0  # adaln: width of the time features and time embedding (MD4: the head dim); 0 = model_dim.
  config.model.time_hidden_dim = 0  # adaln: hidden width of the time MLP (MD4: 4 × time_dim); 0 = the time embedding's width.
  config.model.adaln_activation = "silu"  # adaln: activation of the time embedding every adaLN projection reads, "silu" or "sigmoid" (MD4).
  config.model.preset = "none"  # "none" or "md4": sets every model choice above to MD4's text network (resolve_preset; docs/md4_parity.md).

  # Device mesh (md4jax.runtime.sharding): data × fsdp × tensor = the device count; one may be -1 (the rest).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # Data parallel: whole params per device group.
  config.mesh.fsdp = 1  # Data parallel with params, optimizer state and EMA sharded on the model dimension.
  config.mesh.tensor = 1  # Tensor parallel: attention heads and MLP width split.

  config.diffusion = ml_collections.ConfigDict()
  config.diffusion.schedule = "linear"  # Masking schedule alpha(t): linear, cosine, loglinear, geometric, polyK; learned (GenMD4): learned_tokenpoly (alpha_v = 1 - t^w_v, one w per token) or learned_poly (one shared w).
  config.diffusion.exponent_init = 1.0  # Learned schedules: initial exponent w (1 = linear).
  config.diffusion.exponent_learning_rate = 1e-2  # Learned schedules: peak learning rate of theta (w = softplus(theta)), same warmup and decay.
  config.diffusion.exponent_gradient = "rloo"  # Learned schedules: gradient of w through the masks, "rloo" (two draws, leave-one-out baseline) or "score" (no baseline).
  config.diffusion.reconstruction_time = 1e-4  # Learned schedules: epsilon; t < epsilon is one reconstruction step (md4jax.diffusion.genmd4); 0 = none.
  config.diffusion.block_size = 0  # Block diffusion (BD3-LM): blocks of this many tokens, each diffused given the clean blocks before it (dividing data.seq_len; a time-free mdm); 0 or seq_len = the whole sequence.
  config.diffusion.endpoint_terms = "sampled"  # Schedules with α(0) < 1 or α(1) > 0: "sampled" (Monte Carlo terms, the exact bound) or "md4" (MD4's constant reconstruction term, no prior term).

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = 1e-3  # Peak learning rate, reached after the warmup.
  config.optimizer.warmup_steps = 100  # Linear warmup from 0; then cosine decay to 0 at num_train_steps.
  config.optimizer.weight_decay = 0.0  # AdamW decoupled decay, on matrices only (not norms, biases).
  config.optimizer.grad_clip_norm = 1.0  # Gradients are rescaled to at most this global norm; 0 = no clipping (MD4).
  config.optimizer.b1 = 0.9  # Adam first-moment decay.
  config.optimizer.b2 = 0.99  # Adam second-moment decay.
  config.optimizer.ema_decay = 0.99  # EMA of params used for eval and sampling, reached after a warm-up (train.ema_decay_at); 0 copies the params.
  config.optimizer.ema_warmup = True  # Warm the EMA decay up from 0.1 (train.ema_decay_at); False: ema_decay from step 0 (MD4).

  config.training = ml_collections.ConfigDict()
  config.training.estimator = "standard"  # NELBO estimator of the loss: standard, forced_target or mask_count.
  config.training.prompt_dropout = 0.0  # Classifier-free guidance: each row's prompt (never scored) is hidden from the mdm with this probability, so it also learns the prompt-free law sample.guidance_scale contrasts; 0 = off.
  config.training.mask_rates = ""  # BD3-LM's clipped schedule: "β,ω" draws each training mask rate uniformly in [β, ω] (lower-variance gradients; not a bound: evaluation scores the full one); "" = [0, 1].
  config.training.loss_units = "nats"  # Unit of the per-token loss whose gradient the optimizer sees: "nats" or "bits" (MD4; the gradient / ln 2).
  config.training.max_checkpoints_to_keep = 3  # Older checkpoints are deleted.
  config.training.grad_accum_steps = 1  # Microbatches per step (gradients summed): the step of the whole batch in less memory.
  config.training.init_from = ""  # A workdir (md4jax-trained or converted) whose newest EMA params start a fresh run at step 0, the EMA at them; its network's param shapes must match (AR → MDM: configs/adapt.py); a workdir with checkpoints of its own resumes them instead; "" = a random init.
  config.training.attention_anneal_steps = 0  # mdm: DiffuLLaMA's annealing over N steps: at step s query i reads keys j <= i and each later one with probability min(1, s / N) (one draw per pair and step): causal at 0, bidirectional from N on (eval and sampling always); 0 = bidirectional throughout.

  config.eval = ml_collections.ConfigDict()
  config.eval.num_sequences = 256  # Held-out sequences; the standard error is over them.
  config.eval.num_mc_samples = 8  # NELBO draws averaged per sequence (mdm only; ar is exact).
  config.eval.estimator = "mask_count"  # NELBO estimator for eval; mask_count has bounded variance.
  config.eval.batch_size = 64  # Sequences per evaluation call, split over all devices.
  config.eval.discrete_steps = "10,50,1000"  # mdm: T of the discrete-time bounds reported beside the continuous one; "" skips them.
  config.eval.num_discrete_draws = 4  # mdm: NELBO draws per sequence of each discrete-time bound (the continuous ones take num_mc_samples).
  config.eval.judge_workdir = ""  # An md4jax AR workdir on the same data: scores the eval rows and fresh samples (generative perplexity); "" = off.
  config.eval.num_judged_samples = 64  # Fresh samples (sample.* settings) scored by the judge; the SE is over them.
  config.eval.profile_bins = 20  # mdm: bins of t in the per-t loss profile (w(t)·CE, one draw per bin and sequence); 0 skips it.
  config.eval.likelihood = "nelbo"  # mdm, final evaluation: also the exact likelihood over orders (docs/math.md § 5b), "order" (left to right) or "orders:K" (importance-weighted over K random orders, between the NLL and the NELBO; K·L calls per sequence); "nelbo": the bounds only.

  # --mode=frontier: fresh samples at every (method, num_steps, temperature), each
  # scored by the judge (eval.judge_workdir) and by the true law where it is known.
  config.frontier = ml_collections.ConfigDict()
  config.frontier.methods = "ancestral,confidence"  # mdm samplers swept (md4jax.sampling.samplers); ar models decode token by token.
  config.frontier.num_steps = "16,64,256"  # mdm sampler steps swept; ar, first_hitting and threshold ignore them.
  config.frontier.thresholds = "0.5,0.7,0.9,0.99"  # method "threshold": the thresholds swept (each in (0, 1]).
  config.frontier.temperatures = "0.7,0.8,0.9,1.0"  # Softmax temperatures swept (each > 0).
  config.frontier.num_samples = 64  # Samples per point; the standard errors are over them.

  config.sample = ml_collections.ConfigDict()
  config.sample.num_samples = 4  # Sequences generated at the end of training and by --mode=sample.
  config.sample.num_steps = 64  # Time-grid steps of the mdm sampler (first_hitting and ar take seq_len calls).
  config.sample.method = "ancestral"  # mdm sampler: ancestral, cached, jump, first_hitting, confidence, threshold or remdm (md4jax.sampling.samplers).
  config.sample.threshold = 0.9  # method "threshold": reveal every masked position whose top probability is >= this, in [0, 1] (0: all in one call).
  config.sample.remask = "cap"  # method "remdm": σ_t of remasking, "cap" (min(η, σ_max)), "rescale" (η σ_max) or "confidence" (σ_max shared by the least confident tokens; η unused).
  config.sample.remask_eta = 0.0  # method "remdm": η in [0, 1]; 0 with cap or rescale is ancestral, token for token.
  config.sample.remask_loop = 0  # method "remdm": ReMDM-loop's extra steps at a fixed α (then only they remask); 0 = none.
  config.sample.remask_loop_alpha = 0.9  # method "remdm": the loop runs once the grid reaches α >= this, in (0, 1).
  config.sample.guidance_scale = 0.0  # Classifier-free guidance w >= 0 (needs sample.prompt): (1 + w) cond − w uncond log-probs, uncond with the prompt masked; 0 = off.
  config.sample.temperature = 1.0  # Softmax temperature of every draw; 1 samples the model, 0 is greedy.
  config.sample.top_k = 0  # Keep only the k most likely tokens of every draw; 0 keeps all.
  config.sample.top_p = 1.0  # Nucleus: keep the smallest set of tokens with this much probability; 1 keeps all.
  config.sample.prompt = ""  # Text every sample starts with (markov: space-separated ids); "" starts from all-mask.
  config.sample.length = 0  # Tokens per sample; 0 = data.seq_len. Longer (mdm): generated block by block.
  config.sample.block_length = 0  # New tokens per window when length > seq_len (mdm); 0 = seq_len // 2. With sample.cache: the decoding block.
  config.sample.cache = "none"  # Fast-dLLM's approximate KV cache, "prefix" or "dual": decode block by block within the context (sample.block_length, dividing the length; time-free mdm); "none" = off.
  config.sample.trajectory = True  # Write trajectory.html and .gif of the first sample (mdm without blocks, length <= seq_len).
  # fmt: on
  return config


CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def load_config(name: str) -> ml_collections.ConfigDict:
  """`get_config()` of configs/<name>.py (or get_config(arg) for "name:arg") in this checkout."""
  name, _, arg = name.partition(":")
  path = CONFIG_DIR / f"{name}.py"
  if not path.is_file():
    raise ValueError(f"No config {name!r}: {path} does not exist.")
  spec = importlib.util.spec_from_file_location(f"md4jax_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a workdir saved (its config.json) on top of base_config: a key an older version
  did not write keeps its base value, which leaves that version's model and run unchanged."""
  config = base_config()

  def merge(node, values: dict, prefix: str):
    for key, value in values.items():
      check(key in node, f"{prefix}{key} (in a saved config) is not a key of this md4jax version.")
      if isinstance(value, dict):
        merge(node[key], value, f"{prefix}{key}.")
      else:
        node[key] = value

  merge(config, saved, "")
  return config


def workdir_config(path, role: str) -> ml_collections.ConfigDict:
  """The config the workdir `path` saved (its config.json, `from_saved`); ValueError naming
  `role` (what named the path, e.g. "training.init_from") when there is none."""
  config_json = pathlib.Path(path) / "config.json"
  check(
    config_json.is_file(),
    f"{role}={str(path)!r}: no config.json there; name a workdir md4jax trained or converted "
    "(python -m md4jax.convert).",
  )
  return from_saved(json.loads(config_json.read_text(encoding="utf-8")))


# Keys that decide what a checkpoint holds (its params' shapes, its vocabulary, the data and
# tokenizer its data state refers to): a resumed run may not change them. Every other key
# (steps, logging, evaluation, sampling, batch size, optimizer, training, mesh, model.dtype,
# model.remat, model.attention, diffusion.schedule) may change between runs of one workdir.
CHECKPOINT_KEYS = (
  "seed",
  "data.dataset",
  "data.vocab_size",
  "data.seq_len",
  "data.path",
  "data.tokenizer",
  "data.bpe_vocab_size",
  "data.tokenizer_path",
  "data.packing",
  "data.text_field",
  "data.prompt_field",
  "data.response_field",
  "data.language_seed",
  "data.concentration",
  "model.type",
  "model.num_layers",
  "model.model_dim",
  "model.num_heads",
  "model.mlp_dim",
  "model.time_conditioning",
  "model.scan_layers",
  "model.norm",
  "model.mlp",
  "model.embed_dim",
  "model.norm_eps",
  "model.biases",
  "model.time_input",
  "model.time_features",
  "model.time_dim",
  "model.time_hidden_dim",
  "model.adaln_activation",
  "model.num_kv_heads",
  "model.qkv_bias",
  "model.tie_embeddings",
  "model.rope_base",
  "model.shifted_prediction",
  "model.preset",
)


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """ "key: old → new" for each CHECKPOINT_KEYS entry that differs from the saved config's."""
  changes = []
  saved_value = lambda name: functools.reduce(
    lambda d, k: d.get(k, {}) if isinstance(d, dict) else {}, name.split("."), saved
  )
  for name in CHECKPOINT_KEYS:
    old = saved_value(name)
    new = key_value(config, name)
    if old != {} and old != new:  # {}: a key older checkpoints did not have.
      changes.append(f"{name}: {old!r} → {new!r}")
  # A learned schedule's θ is in the checkpoint: switching to, from or between them changes it.
  old, new = saved_value("diffusion.schedule"), config.diffusion.schedule
  if old not in ({}, new) and {old, new} & set(schedules.LEARNED_NAMES):
    changes.append(f"diffusion.schedule: {old!r} → {new!r}")
  return changes


def check_resume(saved: dict, config: ml_collections.ConfigDict, where):
  """Raises ValueError naming every key whose change the checkpoints in `where` cannot follow."""
  changes = resume_changes(saved, config)
  if changes:
    raise ValueError(
      f"Cannot resume from the checkpoints in {where}: this config changes what they hold "
      f"({'; '.join(changes)}). Run with the old values, or use a new --workdir. Keys that "
      "may change on resume: steps, logging, eval, sample, batch size, optimizer, training, "
      "mesh, model.dtype/remat/attention, diffusion.schedule (between mask-rate schedules)."
    )


def resolve_preset(
  config: ml_collections.ConfigDict, explicit: Iterable[str] = ()
) -> ml_collections.ConfigDict:
  """config with model.preset's values set (a copy; config itself for preset "none").

  Each key the preset sets must be at its base_config value (it takes the preset's) or
  already hold the preset's value; a key in `explicit` (dotted names, e.g. the command
  line's overrides) must hold the preset's value. Anything else raises ValueError naming it.
  """
  values = preset_values(config)
  if not values:
    return config
  check(
    config.model.type == "mdm",
    f"model.preset={config.model.preset!r} is a diffusion denoiser; model.type must be 'mdm', "
    f"got {config.model.type!r}.",
  )
  base, explicit = base_config().model, set(explicit)
  resolved = config.copy_and_resolve_references()
  for key, value in values.items():
    current = config.model[key]
    free = current == base[key] and f"model.{key}" not in explicit
    check(
      free or current == value,
      f"model.preset={config.model.preset!r} sets model.{key}={value!r}, but the config sets "
      f"{current!r}: a preset owns its keys (set it to {value!r}, or leave it at its base "
      f"value{'' if f'model.{key}' in explicit else f' {base[key]!r}'}), or set "
      "model.preset='none' and every model key yourself.",
    )
    resolved.model[key] = value
  return resolved
