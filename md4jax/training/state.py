"""Building a run: the model, the optimizer and the train state, sharded over a mesh.

The state is created directly with its shardings: params, optimizer state and
EMA follow the model's logical axis names through `md4jax.runtime.sharding`'s rules,
so an FSDP mesh never holds a full copy of any of them on one device.

With model.lora_rank > 0 (docs/lora.md) only the LoRA adapters (and a learned schedule's θ)
train: the optimizer updates and keeps moments for them alone, the train step differentiates
them alone, and the EMA holds every param as in any run, its frozen entries a copy of the base.
"""

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from md4jax.model import lora
from md4jax.model import transformer as model_lib
from md4jax.runtime import sharding
from md4jax.training import objective


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: Any
  opt_state: Any
  ema_params: Any  # Used for evaluation and sampling.
  rng: jax.Array  # Raw uint32 key; step k uses fold_in(rng, k).


def build_model(config: ml_collections.ConfigDict) -> model_lib.Transformer:
  m = config.model
  return model_lib.Transformer(
    vocab_size=config.data.vocab_size,
    num_layers=m.num_layers,
    model_dim=m.model_dim,
    num_heads=m.num_heads,
    mlp_dim=m.mlp_dim,
    causal=m.type == "ar",
    time_conditioning=m.time_conditioning,
    dtype=jnp.dtype(m.dtype),
    attention=m.attention,
    remat=m.remat,
    scan_layers=m.scan_layers,
    norm=m.norm,
    mlp=m.mlp,
    embed_dim=m.embed_dim,
    output_init=m.output_init,
    weight_init=m.weight_init,
    norm_eps=m.norm_eps,
    biases=m.biases,
    time_features=m.time_features,
    time_dim=m.time_dim,
    time_hidden_dim=m.time_hidden_dim,
    adaln_activation=m.adaln_activation,
    block_size=block_size(config),
    num_kv_heads=m.num_kv_heads,
    qkv_bias=m.qkv_bias,
    tie_embeddings=m.tie_embeddings,
    rope_base=m.rope_base,
    checkpoint_mask_id=m.checkpoint_mask_id,
    shift_logits=m.shift_logits,
    lora_rank=m.lora_rank,
    lora_alpha=m.lora_alpha,
    self_condition=m.self_condition,
  )


def block_size(config: ml_collections.ConfigDict) -> int:
  """The network's block (block diffusion), 0 when a block is the whole sequence."""
  size = config.diffusion.block_size
  return size if 0 < size < config.data.seq_len else 0


def learning_rate_schedule(
  config: ml_collections.ConfigDict, updates_per_step: int = 1
) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to 0 at the last step; over optimizer
  updates, updates_per_step of them a step (post-training's updates_per_rollout)."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.optimizer.learning_rate,
    warmup_steps=config.optimizer.warmup_steps * updates_per_step,
    decay_steps=config.num_train_steps * updates_per_step,
    end_value=0.0,
  )


def weight_decay_mask(params) -> Any:
  """True for matrices; norm scales, biases (the q/k/v ones are [3, H, Dh]: named, not
  vectors) and other vectors are not decayed."""

  def decays(path, param):
    names = [str(getattr(k, "key", k)) for k in path]
    return param.ndim >= 2 and names[-1] != "bias" and not any("norm" in name for name in names)

  return jax.tree_util.tree_map_with_path(decays, params)


TRAINABLE, FROZEN = "trainable", "frozen"  # The optimizer's labels of params (LoRA runs).


def _is_trainable(path) -> bool:
  """A LoRA run trains the adapters and a learned schedule's θ; everything else is frozen."""
  names = [str(getattr(key, "key", key)) for key in path]
  return lora.is_adapter(names) or (bool(names) and names[0] == objective.SCHEDULE_PARAMS)


def param_labels(params) -> Any:
  """TRAINABLE or FROZEN for every param of a LoRA run. A boxed param (`abstract_state`'s) is
  labelled whole: a frozen one then becomes a bare optax MaskedNode, no box left around it."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: TRAINABLE if _is_trainable(path) else FROZEN,
    params,
    is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
  )


def split_trainable(params, config: ml_collections.ConfigDict) -> tuple[Any, Any]:
  """(trainable, frozen) subtrees of a params tree (each nested as params are); without LoRA,
  (params, None): everything trains."""
  if not config.model.lora_rank:
    return params, None
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params))
  parts = {TRAINABLE: {}, FROZEN: {}}
  for path, leaf in flat.items():
    parts[TRAINABLE if _is_trainable(path) else FROZEN][path] = leaf
  unflatten = flax.traverse_util.unflatten_dict
  return unflatten(parts[TRAINABLE]), unflatten(parts[FROZEN])


def join_trainable(trainable, frozen) -> Any:
  """The params tree of `split_trainable`'s two parts."""
  if frozen is None:
    return trainable
  flatten = lambda tree: flax.traverse_util.flatten_dict(flax.core.unfreeze(tree))
  return flax.traverse_util.unflatten_dict({**flatten(frozen), **flatten(trainable)})


def make_optimizer(
  config: ml_collections.ConfigDict, updates_per_step: int = 1
) -> optax.GradientTransformation:
  """AdamW on everything, after a global-norm clip (none for optimizer.grad_clip_norm = 0, as
  MD4); a learned schedule's θ moves at diffusion.exponent_learning_rate (its Adam step
  rescaled, on the same warmup and decay) and is clipped on its own, so its noisy
  score-function gradient never shrinks the network's step.

  With model.lora_rank > 0 that optimizer sees the trainable params alone (`param_labels`): the
  frozen ones get zero updates and no state, so Adam's moments exist for the adapters only.
  updates_per_step: optimizer updates a step makes (the schedule's; the state is the same)."""
  trainable = _trainable_optimizer(config, updates_per_step)
  if not config.model.lora_rank:
    return trainable
  return optax.multi_transform({TRAINABLE: trainable, FROZEN: optax.set_to_zero()}, param_labels)


def _trainable_optimizer(
  config: ml_collections.ConfigDict, updates_per_step: int
) -> optax.GradientTransformation:
  opt = config.optimizer
  adamw = optax.adamw(
    learning_rate_schedule(config, updates_per_step),
    b1=opt.b1,
    b2=opt.b2,
    weight_decay=opt.weight_decay,
    mask=weight_decay_mask,
  )
  clip = lambda: (
    optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  )
  if not objective.is_learned(config):
    return optax.chain(clip(), adamw)

  def is_theta(params, theta=True):
    return {
      k: jax.tree.map(lambda _, k=k: (k == objective.SCHEDULE_PARAMS) == theta, v)
      for k, v in params.items()
    }

  ratio = config.diffusion.exponent_learning_rate / opt.learning_rate
  return optax.chain(
    optax.masked(clip(), functools.partial(is_theta, theta=False)),
    optax.masked(clip(), is_theta),
    adamw,
    optax.masked(optax.scale(ratio), is_theta),
  )


def _boxed_state(config: ml_collections.ConfigDict, model, optimizer, rng) -> TrainState:
  """A fresh state whose params (and the optimizer state and EMA made from them) are still boxed
  with their logical axis names."""
  params_rng, step_rng = jax.random.split(rng)
  tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
  params = model.init(params_rng, tokens, jnp.ones((1,)))["params"]
  return _fresh_state(config, params, optimizer, step_rng)


def _fresh_state(config: ml_collections.ConfigDict, params, optimizer, step_rng) -> TrainState:
  """Step 0 of a run from the network's `params` (a learned schedule's θ at its start added)."""
  if objective.is_learned(config):
    params = {**params, objective.SCHEDULE_PARAMS: objective.initial_schedule_params(config)}
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=optimizer.init(params),
    ema_params=jax.tree.map(jnp.copy, params),
    rng=step_rng,
  )


def fresh_adapters(config: ml_collections.ConfigDict, model) -> dict:
  """The adapters of a fresh LoRA run of config (`init_state`'s: the same seed, the same values),
  computed without the base params' init (XLA drops what the output does not need)."""
  params_rng, _ = jax.random.split(jax.random.PRNGKey(config.seed))
  tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
  init = lambda rng: lora.adapters(nn.meta.unbox(model.init(rng, tokens, jnp.ones((1,)))["params"]))
  return jax.jit(init)(params_rng)


def starting_params(
  config: ml_collections.ConfigDict, params, source_config: ml_collections.ConfigDict
) -> Any:
  """training.init_from's params as this run starts from them: a LoRA source's adapters folded
  into its kernels (`lora.merged` with source_config, the source workdir's), then, when this run
  has model.lora_rank > 0, fresh adapters beside them (`fresh_adapters`)."""
  base = lora.merged(params, source_config)
  if not config.model.lora_rank:
    return base
  return lora.with_adapters(base, fresh_adapters(config, build_model(config)))


def state_from_params(config: ml_collections.ConfigDict, optimizer, params) -> TrainState:
  """The step-0 state of a run that starts from given network params (converted weights): what
  init_state gives, with `params` in place of the random init (and as the EMA)."""
  _, step_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  return _fresh_state(config, params, optimizer, step_rng)


def abstract_state(config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh) -> TrainState:
  """The state's shapes, dtypes and shardings on `mesh`, without allocating it."""
  boxed = jax.eval_shape(
    functools.partial(_boxed_state, config, model, optimizer), jax.random.PRNGKey(config.seed)
  )
  return jax.tree.map(
    lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
    nn.meta.unbox(boxed),
    sharding.logical_shardings(boxed, mesh),
  )


def state_shardings(state: TrainState) -> TrainState:
  """The sharding of every leaf of a state or of its abstract_state."""
  return jax.tree.map(lambda leaf: leaf.sharding, state)


def init_state(config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh) -> TrainState:
  """A fresh TrainState, created directly with its shardings."""
  shardings = state_shardings(abstract_state(config, model, optimizer, mesh))
  init = lambda rng: nn.meta.unbox(_boxed_state(config, model, optimizer, rng))
  return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(config.seed))
