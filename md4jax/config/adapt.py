"""The validators of adapting a model into a new run (docs/adapt.md): model.shifted_prediction,
training.attention_anneal_steps and training.init_from, for `validate_config`, which runs them
after every section they depend on."""

import ml_collections

from md4jax.config.values import check


def validate_adaptation(config: ml_collections.ConfigDict):
  """Raises ValueError naming the key for an invalid or inconsistent adaptation setting."""
  model, training = config.model, config.training
  check(
    isinstance(model.shifted_prediction, bool),
    f"model.shifted_prediction must be true or false, got {model.shifted_prediction!r}.",
  )
  steps = training.attention_anneal_steps
  check(
    type(steps) is int and steps >= 0,  # pylint: disable=unidiomatic-typecheck  (not bool)
    f"training.attention_anneal_steps must be an integer >= 0 (0: off), got {steps!r}.",
  )
  check(
    steps <= config.num_train_steps,
    f"training.attention_anneal_steps={steps} must be at most num_train_steps="
    f"{config.num_train_steps}: the run must end bidirectional, as it is evaluated and sampled.",
  )
  check(
    isinstance(training.init_from, str),
    f'training.init_from must be a workdir path ("": a random init), got {training.init_from!r}.',
  )
  blocks = 0 < config.diffusion.block_size < config.data.seq_len
  for name, used in (
    ("model.shifted_prediction", model.shifted_prediction),
    ("training.attention_anneal_steps", steps > 0),
  ):
    if not used:
      continue
    check(
      model.type == "mdm",
      f"{name} adapts a masked diffusion model (model.type='mdm'); an ar model is causal and "
      "predicts the next token already.",
    )
    # Block diffusion's pass, its sampler and Fast-dLLM's caches call the network at block
    # offsets without the denoiser's shift or pattern.
    check(
      not blocks,
      f"{name}: block diffusion (diffusion.block_size={config.diffusion.block_size}) has its "
      "own attention pattern; set it to 0.",
    )
    check(
      config.sample.cache == "none",
      f"{name}: sample.cache={config.sample.cache!r} calls the network on cached blocks; "
      "use 'none'.",
    )
  check(
    steps == 0 or model.attention != "splash",
    "training.attention_anneal_steps: the splash kernel takes no attention mask; use "
    "model.attention='xla' (or 'cudnn') for the annealed steps.",
  )
