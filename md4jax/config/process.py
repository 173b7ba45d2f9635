"""The validators of the diffusion process (masked or uniform-state) and of self-conditioning,
for `validate_config`: what each rules out elsewhere in the config, named in one line."""

import ml_collections

from md4jax.config.values import check, check_choice, key_value, parse_list
from md4jax.diffusion import schedules, uniform
from md4jax.sampling import uniform_state


def validate_self_condition(config: ml_collections.ConfigDict):
  """model.self_condition: a second pass reading the first's estimate, of one unshifted stream."""
  model = config.model
  check(
    isinstance(model.self_condition, bool),
    f"model.self_condition must be true or false, got {model.self_condition!r}.",
  )
  if not model.self_condition:
    return
  refused = {
    "model.type": (model.type, "mdm"),
    "model.shifted_prediction": (model.shifted_prediction, False),
    "model.shift_logits": (model.shift_logits, False),
    "eval.likelihood": (config.eval.likelihood, "nelbo"),
    "sample.cache": (config.sample.cache, "none"),
  }
  for name, (value, wanted) in refused.items():
    check(
      value == wanted,
      f"model.self_condition needs {name}={wanted!r}, got {value!r}: a self-conditioned network "
      "reads its estimate of x_0 in one unshifted stream of one block, without a KV cache.",
    )
  check(
    config.diffusion.block_size in (0, config.data.seq_len),
    f"model.self_condition needs diffusion.block_size=0, got {config.diffusion.block_size}: "
    "block diffusion's two-stream pass reads no estimate of x_0.",
  )
  check(
    config.diffusion.schedule not in schedules.LEARNED_NAMES,
    f"model.self_condition takes a mask-rate schedule, not the learned "
    f"{config.diffusion.schedule!r}.",
  )


def validate_process(config: ml_collections.ConfigDict):
  """diffusion.process: the uniform process is an mdm (one block, or block diffusion) with its own
  bound and samplers; each option of the masked process it lacks is named."""
  check_choice(config.diffusion.process, "diffusion.process", uniform.PROCESSES)
  if config.diffusion.process != "uniform":
    return
  only = {
    "model.type": "mdm",
    "model.time_input": "alpha",
    "diffusion.endpoint_terms": "sampled",
    "training.estimator": "standard",
    "training.mask_rates": "",
    "training.prompt_dropout": 0.0,
    "eval.estimator": "standard",
    "eval.likelihood": "nelbo",
    "sample.cache": "none",
    "sample.guidance_scale": 0.0,
    "sample.blocks_after_prompt": False,
    "sample.reveal_counts": "schedule",
  }
  for name, value in only.items():
    check(
      key_value(config, name) == value,
      f"{name}={key_value(config, name)!r}: diffusion.process='uniform' takes {value!r} only "
      "(that setting is the masked process's).",
    )
  check(
    config.model.time_conditioning != "none",
    "model.time_conditioning='none': under diffusion.process='uniform' the posterior of a "
    "token depends on the noise level, so the denoiser must read it (set 'adaln').",
  )
  check(
    config.diffusion.schedule not in schedules.LEARNED_NAMES,
    f"diffusion.schedule={config.diffusion.schedule!r}: GenMD4's learned schedules mask; "
    "diffusion.process='uniform' takes a mask-rate schedule.",
  )
  check(
    config.sample.length <= config.data.seq_len,
    f"sample.length={config.sample.length}: diffusion.process='uniform' samples at most "
    f"data.seq_len={config.data.seq_len} tokens.",
  )
  for name in ("sample.method", "frontier.methods"):
    methods = set(parse_list(key_value(config, name), str.strip))
    check(
      methods <= set(uniform_state.METHODS),
      f"{name}={key_value(config, name)!r}: diffusion.process='uniform' samples with "
      f"{', '.join(uniform_state.METHODS)}.",
    )
