"""The sampling sections' validators (config.sample, config.frontier), for `validate_config`,
which runs them last, in this order."""

import ml_collections

from md4jax.config_values import check, check_choice, check_list, key_value
from md4jax.sampling import prefix_cache, samplers


def validate_sampling(config: ml_collections.ConfigDict):
  """Raises ValueError naming the key for an invalid sample or frontier setting."""
  _validate_sample(config)
  _validate_cache(config)
  _validate_frontier(config)
  _validate_ar_length(config)


def _validate_sample(config: ml_collections.ConfigDict):
  """config.sample: the sampler and its settings, the draw, the length and block length."""
  data, model = config.data, config.model
  check(
    isinstance(config.sample.num_samples, int) and config.sample.num_samples >= 0,
    f"sample.num_samples must be an integer >= 0, got {config.sample.num_samples!r}.",
  )
  check_choice(config.sample.method, "sample.method", samplers.METHODS)
  check(
    config.sample.method not in samplers.TIME_FREE_METHODS or model.time_conditioning == "none",
    f"sample.method={config.sample.method!r} reuses logits across steps, so it needs a "
    "time-free denoiser (model.time_conditioning='none'); use 'ancestral'.",
  )
  check(
    0 <= config.sample.threshold <= 1,
    f"sample.threshold must be in [0, 1], got {config.sample.threshold}.",
  )
  check_choice(config.sample.remask, "sample.remask", samplers.REMASKS)
  check(
    0 <= config.sample.remask_eta <= 1,
    f"sample.remask_eta must be in [0, 1], got {config.sample.remask_eta}.",
  )
  check(
    isinstance(config.sample.remask_loop, int) and config.sample.remask_loop >= 0,
    f"sample.remask_loop must be an integer >= 0, got {config.sample.remask_loop!r}.",
  )
  check(
    0 < config.sample.remask_loop_alpha < 1,
    f"sample.remask_loop_alpha must be in (0, 1), got {config.sample.remask_loop_alpha}.",
  )
  check(
    config.sample.guidance_scale >= 0,
    f"sample.guidance_scale must be >= 0, got {config.sample.guidance_scale}.",
  )
  check(
    config.sample.guidance_scale == 0
    or (config.sample.length or data.seq_len) <= data.seq_len
    or 0 < config.diffusion.block_size < data.seq_len,
    "sample.guidance_scale with sample.length > data.seq_len: the windows past the context "
    "hold no prompt to contrast with; guided generation past the context is block "
    "diffusion's (diffusion.block_size).",
  )
  check(
    config.sample.guidance_scale == 0 or config.sample.prompt,
    "sample.guidance_scale needs sample.prompt: guidance contrasts the prompt with the prompt "
    "masked.",
  )
  sample = config.sample
  check(sample.temperature >= 0, f"sample.temperature must be >= 0, got {sample.temperature}.")
  check(
    isinstance(sample.top_k, int) and sample.top_k >= 0,
    f"sample.top_k must be an integer >= 0 (0: off), got {sample.top_k!r}.",
  )
  check(0 < sample.top_p <= 1, f"sample.top_p must be in (0, 1] (1: off), got {sample.top_p}.")
  for name in ("length", "block_length"):
    check(
      isinstance(sample[name], int) and sample[name] >= 0,
      f"sample.{name} must be an integer >= 0 (0: default), got {sample[name]!r}.",
    )
  check(
    sample.block_length <= data.seq_len,
    f"sample.block_length={sample.block_length} exceeds data.seq_len={data.seq_len}.",
  )


def _validate_cache(config: ml_collections.ConfigDict):
  """sample.cache: block-wise decoding within the context, for a time-free bidirectional mdm."""
  sample, model = config.sample, config.model
  check_choice(sample.cache, "sample.cache", prefix_cache.CACHES)
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
  check(
    length <= config.data.seq_len and sample.block_length > 0 and length % sample.block_length == 0,
    f"sample.cache={sample.cache!r} decodes within the context in blocks: the length {length} "
    f"(sample.length or data.seq_len) must be <= data.seq_len and divisible by "
    f"sample.block_length={sample.block_length} > 0.",
  )


def _validate_frontier(config: ml_collections.ConfigDict):
  """config.frontier's sweeps, and the sample counts standard errors are taken over."""
  model = config.model
  methods = check_list(
    config,
    "frontier.methods",
    str.strip,
    False,
    lambda m: m in samplers.METHODS,
    f"samplers (each one of {', '.join(samplers.METHODS)})",
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
