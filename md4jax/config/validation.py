"""validate_config: every check of a config's values, one validator per config section.

A bad value fails before any compilation, with a message naming the key. The validators run in
one fixed order, so of several bad values the same one is reported every time.
"""

import ml_collections

from md4jax.config import adapt, distill, network, post_train, presets, process, sample
from md4jax.config.values import (
  DATASETS,
  DTYPES,
  LOSS_UNITS,
  MODEL_TYPES,
  PACKINGS,
  TEXT8_VOCAB_SIZE,
  TOKENIZERS,
  check,
  check_choice,
  check_list,
  check_positive_int,
  key_value,
  parse_list,
)
from md4jax.diffusion import bounds, genmd4, schedules
from md4jax.evaluation import likelihoods
from md4jax.runtime import sharding


def validate_config(config: ml_collections.ConfigDict, num_devices: int, platform: str = "cpu"):
  """Raises ValueError naming the key for any invalid or inconsistent value.

  num_devices and platform ("cpu", "gpu", "tpu") are those of the mesh the run uses.
  """
  _validate_counts(config)
  _validate_mesh(config, num_devices)
  network.validate_network(config.model)
  network.validate_attention(config, platform)
  _validate_host(config)
  _validate_data(config.data)
  _validate_model(config)
  _validate_diffusion(config)
  _validate_training(config)
  _validate_eval(config)
  _validate_optimizer(config)
  adapt.validate_adaptation(config)
  sample.validate_sampling(config)
  post_train.validate_post_training(config)
  distill.validate_distillation(config)


def _validate_counts(config: ml_collections.ConfigDict):
  """The keys of every section that count something: positive integers."""
  for name in (
    "num_train_steps",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "batch_size",
    "data.seq_len",
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
    check_positive_int(config, name)


def _validate_mesh(config: ml_collections.ConfigDict, num_devices: int):
  """The mesh fits the devices and splits the batch, the eval batch and the model's widths."""
  for name in sharding.MESH_AXES:
    value = config.mesh[name]
    check(
      type(value) is int and (value > 0 or value == -1),  # pylint: disable=unidiomatic-typecheck  (not bool)
      f"mesh.{name} must be a positive integer or -1 (the remaining devices), got {value!r}.",
    )
  data, fsdp, tensor = sharding.mesh_shape(config.mesh, num_devices)
  model, batch_shards = config.model, data * fsdp
  accum = config.training.grad_accum_steps
  check(
    type(accum) is int and accum >= 1,  # pylint: disable=unidiomatic-typecheck  (not bool)
    f"training.grad_accum_steps must be an integer >= 1, got {accum!r}.",
  )
  check(
    config.batch_size % (accum * batch_shards) == 0,
    f"batch_size={config.batch_size} must split into training.grad_accum_steps={accum} "
    f"microbatches of rows divisible by mesh.data × mesh.fsdp = {batch_shards}.",
  )
  check(
    config.eval.batch_size % batch_shards == 0,
    f"eval.batch_size={config.eval.batch_size} is not divisible by mesh.data × mesh.fsdp = "
    f"{batch_shards}, the devices its rows are split over.",
  )
  check(
    model.model_dim % fsdp == 0,
    f"model.model_dim={model.model_dim} is not divisible by mesh.fsdp={fsdp}, which shards it.",
  )
  for name in ("num_heads", "mlp_dim", "num_kv_heads"):  # num_kv_heads = 0 (num_heads) passes.
    check(
      model[name] % tensor == 0,
      f"model.{name}={model[name]} is not divisible by mesh.tensor={tensor}, which splits it.",
    )


def _validate_host(config: ml_collections.ConfigDict):
  """The CPU host's settings (md4jax.runtime.allocator, cpu_devices)."""
  check(
    isinstance(config.reuse_freed_host_memory, bool),
    f"reuse_freed_host_memory must be True or False, got {config.reuse_freed_host_memory!r}.",
  )
  check(
    type(config.cpu_devices) is int and config.cpu_devices >= 0,
    f"cpu_devices must be an integer >= 0 (0 = one device), got {config.cpu_devices!r}.",
  )


def _validate_data(data: ml_collections.ConfigDict):
  """config.data: the dataset, its sizes, and the keys of markov, text or conditional data."""
  check_choice(data.dataset, "data.dataset", DATASETS)
  check(data.seq_len >= 2, f"data.seq_len must be >= 2, got {data.seq_len}.")
  check(
    type(data.vocab_size) is int  # pylint: disable=unidiomatic-typecheck  (not bool)
    and (data.vocab_size >= 2 or (data.vocab_size == 0 and data.dataset != "markov")),
    f"data.vocab_size must be an integer >= 2, or 0 for text data (the tokenizer's size), got "
    f"{data.vocab_size!r}.",
  )
  if data.dataset == "text8":
    # The mask id is vocab_size: it must be the first id past the data's ids, neither
    # one of them (a masked token would read as a character) nor leave a gap.
    check(
      data.vocab_size in (0, TEXT8_VOCAB_SIZE),
      f"data.vocab_size={data.vocab_size} does not match text8's {TEXT8_VOCAB_SIZE} ids: "
      f"the mask id (= vocab_size) must be {TEXT8_VOCAB_SIZE}, one past the last data id.",
    )
  if data.dataset == "markov":
    check(data.concentration > 0, f"data.concentration must be > 0, got {data.concentration}.")
  else:
    check(
      bool(data.path) or data.dataset in ("lm1b", "owt"),
      f"data.path must name a local file or folder when data.dataset={data.dataset!r}.",
    )
    check_choice(data.tokenizer, "data.tokenizer", TOKENIZERS)
    check_choice(data.packing, "data.packing", PACKINGS)
    check(
      isinstance(data.worker_count, int) and data.worker_count >= 0,
      f"data.worker_count must be an integer >= 0, got {data.worker_count!r}.",
    )
    check(
      data.bpe_vocab_size >= 258 or data.tokenizer != "bpe",
      f"data.bpe_vocab_size must be >= 258 (256 bytes, EOS and a merge), got {data.bpe_vocab_size}.",
    )
  if data.dataset == "conditional":
    for name in ("prompt_field", "response_field"):
      check(
        isinstance(data[name], str) and bool(data[name]),
        f"data.{name} must name a JSONL field, got {data[name]!r}.",
      )
    check(
      data.prompt_field != data.response_field,
      f"data.prompt_field and data.response_field are both {data.prompt_field!r}.",
    )


def _validate_model(config: ml_collections.ConfigDict):
  """config.model: its type, expanded preset and dtype (the network's own checks: network.py)."""
  model = config.model
  check_choice(model.type, "model.type", MODEL_TYPES)
  for key, value in presets.preset_values(config).items():
    check(
      model[key] == value,
      f"model.preset={model.preset!r} sets model.{key}={value!r}, but the config holds "
      f"{model[key]!r}: expand the preset first (md4jax.config.expand_preset; loading a config "
      "does).",
    )
  check_choice(model.dtype, "model.dtype", DTYPES)
  check(
    model.type == "mdm" or model.time_conditioning == "none",
    "model.time_conditioning must be 'none' for model.type='ar' (it has no diffusion time).",
  )


def _validate_diffusion(config: ml_collections.ConfigDict):
  """config.diffusion: the schedule, and what a learned one rules out in other sections."""
  model = config.model
  diff = config.diffusion
  if diff.schedule in schedules.LEARNED_NAMES:
    check(model.type == "mdm", f"diffusion.schedule={diff.schedule!r} is for mdm models.")
    check(
      model.time_conditioning != "none",
      f"diffusion.schedule={diff.schedule!r} masks each token value at its own rate, so the "
      "posterior depends on t: it needs a time-conditioned denoiser (model.time_conditioning="
      "'adaln'), not a time-free one.",
    )
    check(diff.exponent_init > 0, f"diffusion.exponent_init must be > 0, got {diff.exponent_init}.")
    check(
      diff.exponent_learning_rate >= 0,
      f"diffusion.exponent_learning_rate must be >= 0, got {diff.exponent_learning_rate}.",
    )
    check_choice(diff.exponent_gradient, "diffusion.exponent_gradient", genmd4.GRADIENTS)
    check(
      0 <= diff.reconstruction_time < 1,
      f"diffusion.reconstruction_time must be in [0, 1), got {diff.reconstruction_time}.",
    )
    for name in ("training.estimator", "eval.estimator"):
      check(
        key_value(config, name) == "standard",
        f"{name}={key_value(config, name)!r}: a learned (state-dependent) schedule has its own "
        "bound; set it to 'standard'.",
      )
    check(
      config.sample.method == "ancestral",
      f"sample.method={config.sample.method!r}: a learned schedule samples with 'ancestral' only.",
    )
    check(
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
  check_choice(diff.endpoint_terms, "diffusion.endpoint_terms", bounds.ENDPOINT_TERMS)
  _validate_blocks(config)
  process.validate_process(config)
  process.validate_self_condition(config)


def _validate_blocks(config: ml_collections.ConfigDict):
  """diffusion.block_size: block diffusion trains an mdm in one two-stream pass, time-free under
  masking, reading each position's noise level under uniform noise (`validate_process`)."""
  size, seq_len = config.diffusion.block_size, config.data.seq_len
  check(
    size >= 0 and (size == 0 or seq_len % size == 0),
    f"diffusion.block_size={size} must be 0 or divide data.seq_len={seq_len}.",
  )
  if not 0 < size < seq_len or config.diffusion.process == "uniform":
    return
  needs = {
    "model.type": (config.model.type, "mdm"),
    "model.time_conditioning": (config.model.time_conditioning, "none"),
    "training.estimator": (config.training.estimator, "standard"),
  }
  for name, (value, wanted) in needs.items():
    check(
      value == wanted,
      f"diffusion.block_size={size} (block diffusion) needs {name}={wanted!r}, got {value!r}: "
      "the training pass draws t per block and scores every masked token.",
    )
  check(
    config.diffusion.schedule not in schedules.LEARNED_NAMES,
    "diffusion.block_size: block diffusion takes a mask-rate schedule, not a learned one.",
  )
  schedule = schedules.get_schedule(config.diffusion.schedule)
  check(
    not (schedule.needs_reconstruction_term or schedule.needs_prior_term)
    or config.diffusion.endpoint_terms == "md4",
    f"diffusion.block_size: schedule {config.diffusion.schedule!r} needs endpoint terms; block "
    "diffusion's training pass has MD4's only (diffusion.endpoint_terms='md4').",
  )


def _validate_training(config: ml_collections.ConfigDict):
  """config.training's choices (grad_accum_steps is checked with the mesh)."""
  training = config.training
  check_choice(training.estimator, "training.estimator", bounds.ESTIMATORS)
  check_choice(training.loss_units, "training.loss_units", LOSS_UNITS)
  check(
    0 <= training.prompt_dropout < 1,
    f"training.prompt_dropout must be in [0, 1), got {training.prompt_dropout}.",
  )
  rates = training.mask_rates
  try:
    low, high = (float(v) for v in rates.split(",")) if rates else (0.0, 1.0)
  except ValueError:
    low, high = 1.0, 0.0  # Unparseable: fails the check below.
  check(
    0 <= low < high <= 1,
    f'training.mask_rates must be "" or "β,ω" with 0 <= β < ω <= 1, got {rates!r}.',
  )
  check(
    not rates
    or (
      config.model.type == "mdm"
      and training.estimator == "standard"
      and config.diffusion.schedule not in schedules.LEARNED_NAMES
    ),
    "training.mask_rates clips the standard estimator of an mdm with a mask-rate schedule "
    f"(training.estimator={training.estimator!r}, diffusion.schedule="
    f"{config.diffusion.schedule!r}).",
  )
  check(
    training.prompt_dropout == 0 or config.model.type == "mdm",
    "training.prompt_dropout hides prompts from a masked diffusion model; model.type is 'ar'.",
  )


def _validate_eval(config: ml_collections.ConfigDict):
  """config.eval's estimator, discrete steps, profile bins, judge and likelihood."""
  check_choice(config.eval.estimator, "eval.estimator", bounds.ESTIMATORS)
  check_list(
    config,
    "eval.discrete_steps",
    int,
    True,
    lambda t: t > 0,
    'positive integers (e.g. "10,50,1000")',
  )
  check(
    type(config.eval.profile_bins) is int and config.eval.profile_bins >= 0,  # pylint: disable=unidiomatic-typecheck  (not bool)
    f"eval.profile_bins must be an integer >= 0 (0: off), got {config.eval.profile_bins!r}.",
  )
  check(
    isinstance(config.eval.judge_workdir, str),
    f'eval.judge_workdir must be a path string ("": off), got {config.eval.judge_workdir!r}.',
  )
  _validate_likelihood(config)


def _validate_likelihood(config: ml_collections.ConfigDict):
  """eval.likelihood: orders over the whole sequence of a time-free posterior (docs/math.md § 5b)."""
  try:
    kind, _ = likelihoods.parse_likelihood(config.eval.likelihood)
  except ValueError as e:
    raise ValueError(f"Invalid config: {e}") from None
  if kind == "nelbo":
    return
  name = f"eval.likelihood={config.eval.likelihood!r}"
  check(
    config.model.type == "mdm",
    f"{name} scores a masked diffusion model's orders; an ar model's NLL is exact (use 'nelbo').",
  )
  check(
    not 0 < config.diffusion.block_size < config.data.seq_len,
    f"{name}: block diffusion (diffusion.block_size={config.diffusion.block_size}) is "
    "autoregressive over blocks, not a model of any order (use 'nelbo').",
  )
  check(
    config.diffusion.schedule not in schedules.LEARNED_NAMES,
    f"{name}: a learned schedule's posterior depends on t (each token has its own rate), so it "
    "has no order likelihood (use 'nelbo').",
  )


def _validate_optimizer(config: ml_collections.ConfigDict):
  """config.optimizer: rates, decays, a warmup within the run, clipping."""
  opt = config.optimizer
  check(opt.learning_rate > 0, f"optimizer.learning_rate must be > 0, got {opt.learning_rate}.")
  check(
    isinstance(opt.warmup_steps, int) and 0 <= opt.warmup_steps < config.num_train_steps,
    f"optimizer.warmup_steps must be an integer in [0, num_train_steps={config.num_train_steps}), "
    f"got {opt.warmup_steps!r}.",
  )
  check(opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}.")
  check(
    opt.grad_clip_norm >= 0,
    f"optimizer.grad_clip_norm must be >= 0 (0: no clipping), got {opt.grad_clip_norm}.",
  )
  check(
    isinstance(opt.ema_warmup, bool),
    f"optimizer.ema_warmup must be true or false, got {opt.ema_warmup!r}.",
  )
  for name in ("b1", "b2", "ema_decay"):
    check(0 <= opt[name] < 1, f"optimizer.{name} must be in [0, 1), got {opt[name]}.")
