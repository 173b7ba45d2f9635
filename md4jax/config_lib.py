"""The config structure shared by every `configs/*.py`, and its validation.

`base_config()` declares every key once, with what it means; a config file
overrides values only. `validate_config` holds all checks, so a bad value fails
before any compilation, with a message naming the key.

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
import pathlib
from typing import Iterable

import ml_collections

from md4jax.diffusion import bounds, genmd4, schedules
from md4jax.model import transformer as model_lib
from md4jax.runtime import sharding
from md4jax.sampling import samplers

DATASETS = ("markov", "text8", "localtext", "conditional", "lm1b", "owt")
TOKENIZERS = ("char", "byte", "bpe")
PACKINGS = ("concat", "documents")
MODEL_TYPES = ("mdm", "ar")
TIME_CONDITIONINGS = ("none", "adaln")
PRESETS = ("none", "md4")
LOSS_UNITS = ("nats", "bits")
DTYPES = ("float32", "bfloat16")
# text8: lowercase a-z and space, one id per character.
TEXT8_VOCAB_SIZE = 27


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
  # Faster CPU steps (default: 15%, eval 34%; 6 layers/384: 11%) for memory: the heap grows by a few
  # temporaries' worth first (6 layers/384: resident 2.3 -> 6.7 GB): see md4jax.runtime.allocator.
  config.reuse_freed_host_memory = False  # CPU, glibc: one malloc arena that never unmaps, so temporaries reuse pages.
  # A small model's step is hundreds of small ops that 2 cores share poorly; a device per core
  # runs its half of the batch whole (default: 1.4x the steps per second of one device).
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
  config.model.output_init = "normal"  # Init of the logits layer: "normal" (as model.weight_init's other matrices) or "zeros" (as MD4).
  config.model.weight_init = "normal"  # "normal" (std 0.02, residual-stream outputs 0.02/√(2N)), "fan_in" (truncated normal, variance 1/fan_in) or "fan_in_mlp_depth" (MD4: the MLP's at (2/N)/fan_in).
  config.model.norm_eps = 1e-6  # Epsilon of every norm (MD4: 1e-5).
  config.model.biases = False  # Biases on the embedding projection, the time MLP and the adaLN projections (MD4); never on attention, MLP or logits.
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
  config.training.loss_units = "nats"  # Unit of the per-token loss whose gradient the optimizer sees: "nats" or "bits" (MD4; the gradient / ln 2).
  config.training.max_checkpoints_to_keep = 3  # Older checkpoints are deleted.
  config.training.grad_accum_steps = 1  # Microbatches per step (gradients summed): the step of the whole batch in less memory.

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
  config.sample.block_length = 0  # New tokens per window when length > seq_len (mdm); 0 = seq_len // 2.
  config.sample.trajectory = True  # Write trajectory.html and .gif of the first sample (mdm, length <= seq_len).
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
    new = _value(config, name)
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


def _value(config, name: str):
  """The value of a dotted key such as "eval.discrete_steps"."""
  return functools.reduce(getattr, name.split("."), config)


def md4_mlp_dim(model_dim: int) -> int:
  """MD4's MLP width for a model width D: 2/3 of 4 D, rounded up to a multiple of 32."""
  return -(-(8 * model_dim // 3) // 32) * 32


def preset_values(config: ml_collections.ConfigDict) -> dict:
  """{model key: value} that config.model.preset sets, for this config's widths ({} for "none").

  "md4": MD4's text network (google-deepmind/md4, md4/networks/transformer.py with
  md4/configs/md4/text8.py's choices), whose per-head width is also its token-embedding
  and time-embedding width.
  """
  model = config.model
  _check_choice(model.preset, "model.preset", PRESETS)
  if model.preset == "none":
    return {}
  head_dim = model.model_dim // model.num_heads
  return {
    "time_conditioning": "adaln",
    "time_input": "t",
    "time_features": "ddpm",
    "time_dim": head_dim,
    "time_hidden_dim": 4 * head_dim,
    "adaln_activation": "sigmoid",
    "weight_init": "fan_in_mlp_depth",
    "norm": "layer",
    "norm_eps": 1e-5,
    "biases": True,
    "mlp": "sigmoid_glu",
    "mlp_dim": md4_mlp_dim(model.model_dim),
    "embed_dim": head_dim,
    "output_init": "zeros",
  }


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
  _check(
    config.model.type == "mdm",
    f"model.preset={config.model.preset!r} is a diffusion denoiser; model.type must be 'mdm', "
    f"got {config.model.type!r}.",
  )
  base, explicit = base_config().model, set(explicit)
  resolved = config.copy_and_resolve_references()
  for key, value in values.items():
    current = config.model[key]
    free = current == base[key] and f"model.{key}" not in explicit
    _check(
      free or current == value,
      f"model.preset={config.model.preset!r} sets model.{key}={value!r}, but the config sets "
      f"{current!r}: a preset owns its keys (set it to {value!r}, or leave it at its base "
      f"value{'' if f'model.{key}' in explicit else f' {base[key]!r}'}), or set "
      "model.preset='none' and every model key yourself.",
    )
    resolved.model[key] = value
  return resolved


def parse_list(text: str, kind=int) -> tuple:
  """The comma-separated values of a config string, converted by `kind` ("" = none)."""
  return tuple(kind(part) for part in text.split(",") if part.strip())


OR_EMPTY = ' (or "" for none)'


def _check_list(config, name: str, kind, allow_empty: bool, is_valid, what: str):
  """A comma-separated list key: parses, values valid and distinct."""
  text = _value(config, name)
  try:
    values = parse_list(text, kind) if isinstance(text, str) else None
  except ValueError:
    values = None
  _check(
    values is not None
    and (values or allow_empty)
    and all(map(is_valid, values))
    and len(set(values)) == len(values),
    f"{name} must be distinct {what} separated by commas{OR_EMPTY if allow_empty else ''}, "
    f"got {text!r}.",
  )
  return values


def _check(condition: bool, message: str):
  if not condition:
    raise ValueError(f"Invalid config: {message}")


def _check_positive_int(config, name: str):
  value = _value(config, name)
  _check(
    isinstance(value, int) and not isinstance(value, bool) and value > 0,
    f"{name} must be a positive integer, got {value!r}.",
  )


def _check_choice(value, name: str, choices):
  _check(value in choices, f"{name}={value!r} is unknown; valid: {', '.join(choices)}.")


def _validate_parallelism(config: ml_collections.ConfigDict, num_devices: int, platform: str):
  """The mesh fits the devices and splits the batch, the model and the attention backend fit it."""
  for name in sharding.MESH_AXES:
    value = config.mesh[name]
    _check(
      type(value) is int and (value > 0 or value == -1),  # pylint: disable=unidiomatic-typecheck  (not bool)
      f"mesh.{name} must be a positive integer or -1 (the remaining devices), got {value!r}.",
    )
  data, fsdp, tensor = sharding.mesh_shape(config.mesh, num_devices)
  model, batch_shards = config.model, data * fsdp
  accum = config.training.grad_accum_steps
  _check(
    type(accum) is int and accum >= 1,  # pylint: disable=unidiomatic-typecheck  (not bool)
    f"training.grad_accum_steps must be an integer >= 1, got {accum!r}.",
  )
  _check(
    config.batch_size % (accum * batch_shards) == 0,
    f"batch_size={config.batch_size} must split into training.grad_accum_steps={accum} "
    f"microbatches of rows divisible by mesh.data × mesh.fsdp = {batch_shards}.",
  )
  _check(
    config.eval.batch_size % batch_shards == 0,
    f"eval.batch_size={config.eval.batch_size} is not divisible by mesh.data × mesh.fsdp = "
    f"{batch_shards}, the devices its rows are split over.",
  )
  _check(
    model.model_dim % fsdp == 0,
    f"model.model_dim={model.model_dim} is not divisible by mesh.fsdp={fsdp}, which shards it.",
  )
  for name in ("num_heads", "mlp_dim"):
    _check(
      model[name] % tensor == 0,
      f"model.{name}={model[name]} is not divisible by mesh.tensor={tensor}, which splits it.",
    )
  _check_choice(model.attention, "model.attention", model_lib.ATTENTIONS)
  _check_choice(model.remat, "model.remat", model_lib.REMATS)
  _check_choice(model.norm, "model.norm", model_lib.NORMS)
  _check_choice(model.mlp, "model.mlp", model_lib.MLPS)
  _check_choice(model.output_init, "model.output_init", model_lib.OUTPUT_INITS)
  _check_choice(model.weight_init, "model.weight_init", model_lib.WEIGHT_INITS)
  _check_choice(model.time_input, "model.time_input", bounds.TIME_INPUTS)
  _check_choice(model.time_features, "model.time_features", model_lib.TIME_FEATURES)
  _check_choice(model.adaln_activation, "model.adaln_activation", model_lib.ADALN_ACTIVATIONS)
  _check(
    isinstance(model.norm_eps, float) and model.norm_eps > 0,
    f"model.norm_eps must be a float > 0, got {model.norm_eps!r}.",
  )
  _check(
    isinstance(model.biases, bool), f"model.biases must be true or false, got {model.biases!r}."
  )
  for name in ("time_dim", "time_hidden_dim"):
    _check(
      type(model[name]) is int and model[name] >= 0,  # pylint: disable=unidiomatic-typecheck
      f"model.{name} must be an integer >= 0 (0: the default width), got {model[name]!r}.",
    )
  _check(
    model.time_features != "ddpm" or (model.time_dim or model.model_dim) >= 4,
    f"model.time_features='ddpm' needs a time width (model.time_dim, 0: model_dim) >= 4, "
    f"got {model.time_dim or model.model_dim}.",
  )
  _check(
    type(model.embed_dim) is int and model.embed_dim >= 0,  # pylint: disable=unidiomatic-typecheck
    f"model.embed_dim must be an integer >= 0 (0: model_dim), got {model.embed_dim!r}.",
  )
  _check(
    isinstance(model.scan_layers, bool),
    f"model.scan_layers must be true or false, got {model.scan_layers!r}.",
  )
  head_dim = model.model_dim // model.num_heads
  if model.attention == "cudnn":
    _check(
      platform in ("gpu", "cuda"),
      f"model.attention='cudnn' runs on NVIDIA GPUs only; this run's devices are {platform!r}: "
      "use 'xla'.",
    )
    _check(
      model.dtype == "bfloat16",
      f"model.attention='cudnn' (flash attention) needs model.dtype='bfloat16', got {model.dtype!r}.",
    )
    _check(
      head_dim % 8 == 0 and head_dim <= 128,
      f"model.attention='cudnn' needs a head dim (model_dim / num_heads) that is a multiple of 8 "
      f"and at most 128, got {head_dim}.",
    )
  if model.attention == "splash":
    _check(
      platform == "tpu",
      f"model.attention='splash' is a TPU kernel; this run's devices are {platform!r}: use 'xla'.",
    )
    _check(
      config.data.seq_len % 128 == 0,
      f"model.attention='splash' needs data.seq_len divisible by 128, got {config.data.seq_len}.",
    )


def validate_config(config: ml_collections.ConfigDict, num_devices: int, platform: str = "cpu"):
  """Raises ValueError naming the key for any invalid or inconsistent value.

  num_devices and platform ("cpu", "gpu", "tpu") are those of the mesh the run uses.
  """
  for name in (
    "num_train_steps",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "batch_size",
    "data.seq_len",
    "data.vocab_size",
    "model.num_layers",
    "model.model_dim",
    "model.num_heads",
    "model.mlp_dim",
    "training.max_checkpoints_to_keep",
    "eval.num_sequences",
    "eval.num_mc_samples",
    "eval.num_discrete_draws",
    "eval.batch_size",
    "sample.num_steps",
  ):
    _check_positive_int(config, name)
  _validate_parallelism(config, num_devices, platform)
  _check(
    isinstance(config.reuse_freed_host_memory, bool),
    f"reuse_freed_host_memory must be True or False, got {config.reuse_freed_host_memory!r}.",
  )
  _check(
    type(config.cpu_devices) is int and config.cpu_devices >= 0,
    f"cpu_devices must be an integer >= 0 (0 = one device), got {config.cpu_devices!r}.",
  )

  data = config.data
  _check_choice(data.dataset, "data.dataset", DATASETS)
  _check(data.seq_len >= 2, f"data.seq_len must be >= 2, got {data.seq_len}.")
  _check(data.vocab_size >= 2, f"data.vocab_size must be >= 2, got {data.vocab_size}.")
  if data.dataset == "text8":
    # The mask id is vocab_size: it must be the first id past the data's ids, neither
    # one of them (a masked token would read as a character) nor leave a gap.
    _check(
      data.vocab_size == TEXT8_VOCAB_SIZE,
      f"data.vocab_size={data.vocab_size} does not match text8's {TEXT8_VOCAB_SIZE} ids: "
      f"the mask id (= vocab_size) must be {TEXT8_VOCAB_SIZE}, one past the last data id.",
    )
  if data.dataset == "markov":
    _check(data.concentration > 0, f"data.concentration must be > 0, got {data.concentration}.")
  else:
    _check(
      bool(data.path) or data.dataset in ("lm1b", "owt"),
      f"data.path must name a local file or folder when data.dataset={data.dataset!r}.",
    )
    _check_choice(data.tokenizer, "data.tokenizer", TOKENIZERS)
    _check_choice(data.packing, "data.packing", PACKINGS)
    _check(
      isinstance(data.worker_count, int) and data.worker_count >= 0,
      f"data.worker_count must be an integer >= 0, got {data.worker_count!r}.",
    )
    _check(
      data.bpe_vocab_size >= 258 or data.tokenizer != "bpe",
      f"data.bpe_vocab_size must be >= 258 (256 bytes, EOS and a merge), got {data.bpe_vocab_size}.",
    )
  if data.dataset == "conditional":
    for name in ("prompt_field", "response_field"):
      _check(
        isinstance(data[name], str) and bool(data[name]),
        f"data.{name} must name a JSONL field, got {data[name]!r}.",
      )
    _check(
      data.prompt_field != data.response_field,
      f"data.prompt_field and data.response_field are both {data.prompt_field!r}.",
    )

  model = config.model
  _check_choice(model.type, "model.type", MODEL_TYPES)
  _check_choice(model.time_conditioning, "model.time_conditioning", TIME_CONDITIONINGS)
  for key, value in preset_values(config).items():
    _check(
      model[key] == value,
      f"model.preset={model.preset!r} sets model.{key}={value!r}, but the config holds "
      f"{model[key]!r}: resolve the preset first (config_lib.resolve_preset; every mode does).",
    )
  _check_choice(model.dtype, "model.dtype", DTYPES)
  _check(
    model.model_dim % model.num_heads == 0 and (model.model_dim // model.num_heads) % 2 == 0,
    f"model.model_dim={model.model_dim} / model.num_heads={model.num_heads} must be an even "
    "integer head dim (RoPE rotates pairs).",
  )
  _check(
    model.type == "mdm" or model.time_conditioning == "none",
    "model.time_conditioning must be 'none' for model.type='ar' (it has no diffusion time).",
  )

  diff = config.diffusion
  if diff.schedule in schedules.LEARNED_NAMES:
    _check(model.type == "mdm", f"diffusion.schedule={diff.schedule!r} is for mdm models.")
    _check(
      model.time_conditioning != "none",
      f"diffusion.schedule={diff.schedule!r} masks each token value at its own rate, so the "
      "posterior depends on t: it needs a time-conditioned denoiser (model.time_conditioning="
      "'adaln'), not a time-free one.",
    )
    _check(
      diff.exponent_init > 0, f"diffusion.exponent_init must be > 0, got {diff.exponent_init}."
    )
    _check(
      diff.exponent_learning_rate >= 0,
      f"diffusion.exponent_learning_rate must be >= 0, got {diff.exponent_learning_rate}.",
    )
    _check_choice(diff.exponent_gradient, "diffusion.exponent_gradient", genmd4.GRADIENTS)
    _check(
      0 <= diff.reconstruction_time < 1,
      f"diffusion.reconstruction_time must be in [0, 1), got {diff.reconstruction_time}.",
    )
    for name in ("training.estimator", "eval.estimator"):
      _check(
        _value(config, name) == "standard",
        f"{name}={_value(config, name)!r}: a learned (state-dependent) schedule has its own "
        "bound; set it to 'standard'.",
      )
    _check(
      config.sample.method == "ancestral",
      f"sample.method={config.sample.method!r}: a learned schedule samples with 'ancestral' only.",
    )
    _check(
      set(parse_list(config.frontier.methods, str.strip)) <= {"ancestral"},
      "frontier.methods: a learned schedule samples with 'ancestral' only.",
    )
  else:
    try:
      schedules.get_schedule(diff.schedule)
    except ValueError as e:
      raise ValueError(
        f"Invalid config: diffusion.schedule: {e} Learned: {', '.join(schedules.LEARNED_NAMES)}."
      ) from None
  _check_choice(diff.endpoint_terms, "diffusion.endpoint_terms", bounds.ENDPOINT_TERMS)
  _check_choice(config.training.estimator, "training.estimator", bounds.ESTIMATORS)
  _check_choice(config.training.loss_units, "training.loss_units", LOSS_UNITS)
  _check_choice(config.eval.estimator, "eval.estimator", bounds.ESTIMATORS)
  _check_list(
    config,
    "eval.discrete_steps",
    int,
    True,
    lambda t: t > 0,
    'positive integers (e.g. "10,50,1000")',
  )
  _check(
    type(config.eval.profile_bins) is int and config.eval.profile_bins >= 0,  # pylint: disable=unidiomatic-typecheck  (not bool)
    f"eval.profile_bins must be an integer >= 0 (0: off), got {config.eval.profile_bins!r}.",
  )
  _check(
    isinstance(config.eval.judge_workdir, str),
    f'eval.judge_workdir must be a path string ("": off), got {config.eval.judge_workdir!r}.',
  )

  opt = config.optimizer
  _check(opt.learning_rate > 0, f"optimizer.learning_rate must be > 0, got {opt.learning_rate}.")
  _check(
    isinstance(opt.warmup_steps, int) and 0 <= opt.warmup_steps < config.num_train_steps,
    f"optimizer.warmup_steps must be an integer in [0, num_train_steps={config.num_train_steps}), "
    f"got {opt.warmup_steps!r}.",
  )
  _check(opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}.")
  _check(
    opt.grad_clip_norm >= 0,
    f"optimizer.grad_clip_norm must be >= 0 (0: no clipping), got {opt.grad_clip_norm}.",
  )
  _check(
    isinstance(opt.ema_warmup, bool),
    f"optimizer.ema_warmup must be true or false, got {opt.ema_warmup!r}.",
  )
  for name in ("b1", "b2", "ema_decay"):
    _check(0 <= opt[name] < 1, f"optimizer.{name} must be in [0, 1), got {opt[name]}.")

  _check(
    isinstance(config.sample.num_samples, int) and config.sample.num_samples >= 0,
    f"sample.num_samples must be an integer >= 0, got {config.sample.num_samples!r}.",
  )
  _check_choice(config.sample.method, "sample.method", samplers.METHODS)
  _check(
    config.sample.method not in samplers.TIME_FREE_METHODS or model.time_conditioning == "none",
    f"sample.method={config.sample.method!r} reuses logits across steps, so it needs a "
    "time-free denoiser (model.time_conditioning='none'); use 'ancestral'.",
  )
  _check(
    0 <= config.sample.threshold <= 1,
    f"sample.threshold must be in [0, 1], got {config.sample.threshold}.",
  )
  _check_choice(config.sample.remask, "sample.remask", samplers.REMASKS)
  _check(
    0 <= config.sample.remask_eta <= 1,
    f"sample.remask_eta must be in [0, 1], got {config.sample.remask_eta}.",
  )
  _check(
    isinstance(config.sample.remask_loop, int) and config.sample.remask_loop >= 0,
    f"sample.remask_loop must be an integer >= 0, got {config.sample.remask_loop!r}.",
  )
  _check(
    0 < config.sample.remask_loop_alpha < 1,
    f"sample.remask_loop_alpha must be in (0, 1), got {config.sample.remask_loop_alpha}.",
  )
  _check(
    config.sample.guidance_scale >= 0,
    f"sample.guidance_scale must be >= 0, got {config.sample.guidance_scale}.",
  )
  _check(
    config.sample.guidance_scale == 0 or config.sample.prompt,
    "sample.guidance_scale needs sample.prompt: guidance contrasts the prompt with the prompt "
    "masked.",
  )
  sample = config.sample
  _check(sample.temperature >= 0, f"sample.temperature must be >= 0, got {sample.temperature}.")
  _check(
    isinstance(sample.top_k, int) and sample.top_k >= 0,
    f"sample.top_k must be an integer >= 0 (0: off), got {sample.top_k!r}.",
  )
  _check(0 < sample.top_p <= 1, f"sample.top_p must be in (0, 1] (1: off), got {sample.top_p}.")
  for name in ("length", "block_length"):
    _check(
      isinstance(sample[name], int) and sample[name] >= 0,
      f"sample.{name} must be an integer >= 0 (0: default), got {sample[name]!r}.",
    )
  _check(
    sample.block_length <= data.seq_len,
    f"sample.block_length={sample.block_length} exceeds data.seq_len={data.seq_len}.",
  )
  methods = _check_list(
    config,
    "frontier.methods",
    str.strip,
    False,
    lambda m: m in samplers.METHODS,
    f"samplers (each one of {', '.join(samplers.METHODS)})",
  )
  for method in set(methods) & set(samplers.TIME_FREE_METHODS):
    _check(
      model.time_conditioning == "none",
      f"frontier.methods has {method!r}, which needs model.time_conditioning='none'.",
    )
  _check_list(
    config, "frontier.thresholds", float, False, lambda t: 0 < t <= 1, "thresholds in (0, 1]"
  )
  _check_list(config, "frontier.num_steps", int, False, lambda t: t > 0, "positive integers")
  _check_list(config, "frontier.temperatures", float, False, lambda t: t > 0, "temperatures > 0")
  for name in ("frontier.num_samples", "eval.num_judged_samples"):
    value = _value(config, name)
    _check(
      type(value) is int and value >= 2,  # pylint: disable=unidiomatic-typecheck  (not bool)
      f"{name} must be an integer >= 2 (its standard error is over samples), got {value!r}.",
    )
  _check(
    model.type == "mdm" or sample.length <= data.seq_len,
    f"sample.length={sample.length} > data.seq_len: block-wise generation is for mdm models; "
    "the ar baseline samples up to its context.",
  )
