"""The validators of adapting a model into a new run (docs/adapt.md): model.shifted_prediction,
training.attention_anneal_steps and training.init_from, and of a released dLLM's conventions
(model.checkpoint_mask_id, model.shift_logits: docs/convert.md), for `validate_config`, which runs
them after every section they depend on."""

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
  check(
    isinstance(model.shift_logits, bool),
    f"model.shift_logits must be true or false, got {model.shift_logits!r}.",
  )
  mask_in_vocab = model.checkpoint_mask_id
  check(
    type(mask_in_vocab) is int  # pylint: disable=unidiomatic-typecheck  (not bool)
    and -1 <= mask_in_vocab < config.data.vocab_size,
    f"model.checkpoint_mask_id must be -1 (none) or an id below data.vocab_size="
    f"{config.data.vocab_size}, got {mask_in_vocab!r}.",
  )
  check(
    not (model.shift_logits and model.shifted_prediction),
    "model.shift_logits (Dream's shifted logits) and model.shifted_prediction (shifted inputs) "
    "are two forms of one shift: set one.",
  )
  blocks = 0 < config.diffusion.block_size < config.data.seq_len
  for name, used in (
    ("model.shift_logits", model.shift_logits),
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
