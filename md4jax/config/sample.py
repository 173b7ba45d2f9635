"""The sampling sections' validators (config.sample, config.frontier), for `validate_config`,
which runs them last, in this order."""

import ml_collections

from md4jax.config.values import check, check_choice, check_list, key_value
from md4jax.diffusion import schedules
from md4jax.sampling import samplers, uniform_state

# sample.cache: Fast-dLLM's approximate caches (block diffusion and ar models take the exact one).
CACHES = ("none", "prefix", "dual")


def validate_sampling(config: ml_collections.ConfigDict):
  """Raises ValueError naming the key for an invalid sample or frontier setting."""
  _validate_sample(config)
  _validate_cache(config)
  _validate_frontier(config)
  _validate_ar_length(config)


def _schedule(config: ml_collections.ConfigDict):
  """The schedule the sampler sees (a learned one: its family at the initial exponents)."""
  if config.diffusion.schedule in schedules.LEARNED_NAMES:
    return schedules.get_schedule("tokenpoly", exponents=[config.diffusion.exponent_init])
  return schedules.get_schedule(config.diffusion.schedule)


def _validate_sample(config: ml_collections.ConfigDict):
  """config.sample: the sampler's settings (the library's one check of them), the length and
  block length."""
  data, model, sample = config.data, config.model, config.sample
  check(
    isinstance(sample.num_samples, int) and sample.num_samples >= 0,
    f"sample.num_samples must be an integer >= 0, got {sample.num_samples!r}.",
  )
  check(isinstance(sample.chat, bool), f"sample.chat must be true or false, got {sample.chat!r}.")
  check(
    isinstance(sample.blocks_after_prompt, bool),
    f"sample.blocks_after_prompt must be true or false, got {sample.blocks_after_prompt!r}.",
  )
  check(
    not sample.blocks_after_prompt or (sample.block_length > 0 and model.type == "mdm"),
    "sample.blocks_after_prompt starts sample.block_length's blocks (> 0) of an mdm after "
    f"sample.prompt (from 0 without one); got block_length={sample.block_length}, "
    f"model.type={model.type!r}.",
  )
  check(
    not (sample.blocks_after_prompt and 0 < config.diffusion.block_size < data.seq_len),
    "sample.blocks_after_prompt: block diffusion decodes in its network's own blocks, from "
    "position 0; set it false.",
  )
  check(
    not sample.chat or data.chat_template,
    "sample.chat renders sample.prompt in data.chat_template, which is empty (md4jax.convert "
    "sets it from a folder's tokenizer_config.json).",
  )
  # threshold and top_k hold a value even when unused (0: top_k off).
  check(0 <= sample.threshold <= 1, f"sample.threshold must be in [0, 1], got {sample.threshold}.")
  check(
    isinstance(sample.top_k, int) and sample.top_k >= 0,
    f"sample.top_k must be an integer >= 0 (0: off), got {sample.top_k!r}.",
  )
  if config.diffusion.process == "uniform":  # Its methods: diffusion.process's check.
    check(
      isinstance(sample.num_steps, int) and sample.num_steps >= 1,
      f"sample.num_steps must be an integer >= 1, got {sample.num_steps!r}.",
    )
    check(sample.temperature >= 0, f"sample.temperature must be >= 0, got {sample.temperature}.")
    check(0 < sample.top_p <= 1, f"sample.top_p must be in (0, 1], got {sample.top_p}.")
  else:
    try:
      samplers.check_settings(
        schedule=_schedule(config),
        method=sample.method,
        num_steps=sample.num_steps,
        threshold=sample.threshold if sample.method == "threshold" else None,
        temperature=sample.temperature,
        top_k=sample.top_k or None,
        top_p=sample.top_p,
        confidence=sample.confidence,
        reveal_counts=sample.reveal_counts,
        remask=sample.remask,
        remask_eta=sample.remask_eta,
        remask_loop=sample.remask_loop,
        remask_loop_alpha=sample.remask_loop_alpha,
        guidance_scale=sample.guidance_scale,
        has_prompt=bool(sample.prompt),
        name=lambda argument: f"sample.{argument}",
      )
    except ValueError as e:
      raise ValueError(f"Invalid config: {e}") from None
  check(
    sample.guidance_scale == 0 or model.type == "mdm",
    "sample.guidance_scale contrasts a masked diffusion model's prompt with the prompt masked; "
    "an ar model decodes token by token (set it to 0).",
  )
  check(
    sample.method not in samplers.TIME_FREE_METHODS or model.time_conditioning == "none",
    f"sample.method={sample.method!r} reuses logits across steps, so it needs a "
    "time-free denoiser (model.time_conditioning='none'); use 'ancestral'.",
  )
  for name in ("length", "block_length"):
    check(
      isinstance(sample[name], int) and sample[name] >= 0,
      f"sample.{name} must be an integer >= 0 (0: default), got {sample[name]!r}.",
    )
  check(
    sample.block_length <= data.seq_len,
    f"sample.block_length={sample.block_length} exceeds data.seq_len={data.seq_len}.",
  )
  windows = (sample.length or data.seq_len) > data.seq_len and sample.cache == "none"
  block = sample.block_length or data.seq_len // 2
  check(
    not windows
    or model.type != "mdm"
    or 0 < config.diffusion.block_size < data.seq_len
    or (block and data.seq_len % block == 0),
    f"sample.length={sample.length} > data.seq_len={data.seq_len} samples blocks of "
    f"sample.block_length (0: data.seq_len // 2 = {data.seq_len // 2}) in windows of "
    "data.seq_len, which the block length must divide.",
  )
  check(
    not (windows and model.shift_logits and block == data.seq_len),
    f"sample.length={sample.length} > data.seq_len={data.seq_len} samples blocks of "
    f"sample.block_length={block} in windows of data.seq_len, and model.shift_logits takes a "
    "block's first logits from the position before it, which such a window leaves out; use a "
    "block length below data.seq_len.",
  )


def _validate_cache(config: ml_collections.ConfigDict):
  """sample.cache: block-wise decoding within the context, for a time-free bidirectional mdm."""
  sample, model = config.sample, config.model
  check_choice(sample.cache, "sample.cache", CACHES)
  if sample.cache == "none":
    return
  length = sample.length or config.data.seq_len
  check(
    model.type == "mdm"
    and model.time_conditioning == "none"
    and not 0 < config.diffusion.block_size < config.data.seq_len,
    f"sample.cache={sample.cache!r} serves a time-free bidirectional mdm (model.type='mdm', "
    "model.time_conditioning='none', no diffusion.block_size).",
  )
  # model.shift_logits with a cache: refused by config.adapt, which runs before.
  # Under sample.blocks_after_prompt the blocks tile the length after the prompt, which
  # generate.decoding checks once the prompt is encoded.
  whole = sample.blocks_after_prompt or length % max(sample.block_length, 1) == 0
  check(
    length <= config.data.seq_len and sample.block_length > 0 and whole,
    f"sample.cache={sample.cache!r} decodes within the context in blocks: the length {length} "
    f"(sample.length or data.seq_len) must be <= data.seq_len and divisible by "
    f"sample.block_length={sample.block_length} > 0 (with sample.blocks_after_prompt, the "
    "length after sample.prompt).",
  )


def _validate_frontier(config: ml_collections.ConfigDict):
  """config.frontier's sweeps, and the sample counts standard errors are taken over."""
  model = config.model
  valid = uniform_state.METHODS if config.diffusion.process == "uniform" else samplers.METHODS
  methods = check_list(
    config,
    "frontier.methods",
    str.strip,
    False,
    lambda m: m in valid,
    f"samplers (each one of {', '.join(valid)})",
  )
  for method in set(methods) & set(samplers.TIME_FREE_METHODS):
    check(
      model.time_conditioning == "none",
      f"frontier.methods has {method!r}, which needs model.time_conditioning='none'.",
    )
  check_list(
    config, "frontier.thresholds", float, False, lambda t: 0 < t <= 1, "thresholds in (0, 1]"
  )
  check_list(config, "frontier.num_steps", int, False, lambda t: t > 0, "positive integers")
  check_list(config, "frontier.temperatures", float, False, lambda t: t > 0, "temperatures > 0")
  for name in ("frontier.num_samples", "eval.num_judged_samples"):
    value = key_value(config, name)
    check(
      type(value) is int and value >= 2,  # pylint: disable=unidiomatic-typecheck  (not bool)
      f"{name} must be an integer >= 2 (its standard error is over samples), got {value!r}.",
    )


def _validate_ar_length(config: ml_collections.ConfigDict):
  """An ar model samples within its context; only mdm models generate block by block."""
  data, model, sample = config.data, config.model, config.sample
  check(
    model.type == "mdm" or sample.length <= data.seq_len,
    f"sample.length={sample.length} > data.seq_len: block-wise generation is for mdm models; "
    "the ar baseline samples up to its context.",
  )
