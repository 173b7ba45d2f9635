"""The per-sequence objective of a model on a batch: training and evaluation score rows the same way.

A batch is a dict of [B, L] arrays: `tokens`, `segment_ids` (0 = padding),
`positions` and `editable` (the positions that are masked and scored: never
padding, nor a conditional example's prompt, which the model reads but never
predicts). segment_ids and positions are None when each row is one whole
segment at positions 0 .. L-1 (`md4jax.data.sources.dense_batch`).

The AR model scores all L tokens: its input is [BOS, x_0, ..., x_{L-2}] with
BOS = vocab_size (the id the denoiser's embedding reserves for the mask, which
a causal model never sees otherwise), and its target is x. Its NLL per token is
then comparable to the diffusion NELBO per token.

A learned masking schedule (config.diffusion.schedule in
`schedules.LEARNED_NAMES`, GenMD4) lives in the params beside the network's,
under SCHEDULE_PARAMS: θ [V] (or [1], shared), exponents w = softplus(θ).
`schedule_of` rebuilds the schedule from params and `network_params` strips it.

Block diffusion (config.diffusion.block_size b < L, `md4jax.diffusion.blocks`; under uniform
noise `md4jax.diffusion.uniform.one_pass_block_nelbo`): the standard continuous estimator
(training's) runs the network's two-stream pass once; the other estimators and the
discrete-time bound go through the reference path, one call per block.

Shifted prediction (config.model.shifted_prediction, Dream's, for a model adapted from an ar
one, docs/adapt.md): the mdm network reads z_t as the ar model reads x, [BOS, z_0, ..., z_{L-2}]
(`ar_inputs`), so the output at position i predicts token i from the positions before it and an
ar model's next-token head serves unchanged. BOS is the mask id: position 0 is predicted from a
token that is always masked, as the ar model predicts its first token; z_{L-1} is never read.
`denoiser` and `sampling_denoiser` shift, so training, every bound and every sampler see the
same denoiser; the network itself is unchanged.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections

from md4jax.diffusion import blocks, bounds, schedules, uniform
from md4jax.diffusion.denoiser import Denoiser, estimate, shifted_inputs


def ar_inputs(tokens: jax.Array, bos_id: int, positions: Optional[jax.Array] = None) -> jax.Array:
  """[BOS, x_0, ..., x_{L-2}]: position i predicts x_i from the tokens before it. With positions
  [B, L] (packed documents), each document starts from BOS, never from its predecessor's end."""
  return shifted_inputs(tokens, bos_id, positions)


SCHEDULE_PARAMS = (
  "masking_schedule"  # Top-level params entry of a learned schedule: {"theta": [V] or [1]}.
)


def is_learned(config: ml_collections.ConfigDict) -> bool:
  return config.diffusion.schedule in schedules.LEARNED_NAMES


def initial_schedule_params(config: ml_collections.ConfigDict) -> dict:
  """θ with softplus(θ) = diffusion.exponent_init: one per token, or one shared."""
  size = config.data.vocab_size if config.diffusion.schedule == "learned_tokenpoly" else 1
  w = config.diffusion.exponent_init
  theta = w + jnp.log(-jnp.expm1(-jnp.float32(w)))  # softplus⁻¹(w), stable for any w > 0.
  return {"theta": jnp.full((size,), theta, jnp.float32)}


def exponents(params: Any, config: ml_collections.ConfigDict) -> jax.Array:
  """The learned schedule's w [V] (a shared exponent broadcast to every token)."""
  theta = params[SCHEDULE_PARAMS]["theta"]
  return jnp.broadcast_to(jax.nn.softplus(theta), (config.data.vocab_size,))


def schedule_of(params: Any, config: ml_collections.ConfigDict):
  """The masking schedule: config.diffusion.schedule, or the one learned in params."""
  if is_learned(config):
    return schedules.get_schedule("tokenpoly", exponents=exponents(params, config))
  return schedules.get_schedule(config.diffusion.schedule)


def network_params(params: Any) -> Any:
  """The network's params alone (without a learned schedule's θ)."""
  if isinstance(params, dict) and SCHEDULE_PARAMS in params:
    return {k: v for k, v in params.items() if k != SCHEDULE_PARAMS}
  return params


def denoiser(
  model,
  params,
  batch: dict,
  hidden: Optional[jax.Array] = None,
  *,
  config: ml_collections.ConfigDict,
  attention_mask: Optional[jax.Array] = None,
  self_condition_key: Optional[jax.Array] = None,
):
  """denoise_fn(z_t, time) -> logits of the mdm model on the batch's documents, the time value
  passed to the network as it is: α(t), or t for config.model.time_input = "t" (the bounds
  call it so, `bounds.nelbo`'s time_input) and for a state-dependent schedule. hidden [B, L]:
  positions the network sees masked (a dropped prompt, `training_loss`). attention_mask [L, L]:
  the network's extra attention pattern (training's annealed one, `adaptation`). A
  self-conditioned network (model.self_condition) reads its own first call's estimate of x_0
  (`_self_conditioned`; self_condition_key: a training step's coin)."""
  segments, positions = batch["segment_ids"], batch["positions"]
  network = network_params(params)
  shown = _hide(hidden, model.vocab_size)
  read = _reader(config, positions)
  # Only a pattern is passed on: any model with apply(variables, z, time, segments, positions)
  # serves (the exact oracle too).
  extra = {} if attention_mask is None else {"attention_mask": attention_mask}

  def call(z_t, time, previous=None):
    estimate = {} if previous is None else {"previous": previous}
    return model.apply(
      {"params": network}, read(shown(z_t)), time, segments, positions, **extra, **estimate
    )

  if not getattr(model, "self_condition", False):
    return lambda z_t, time: call(z_t, time)
  return _self_conditioned(call, self_condition_key)


def _self_conditioned(call, key):
  """denoise_fn(z_t, time) of a self-conditioned network: a second call that reads the first's
  estimate of x_0 (stop-gradient). With key (a training step), on half the steps (one coin per
  step, as Analog Bits and CDCD train) the one call reads no estimate instead."""

  def with_estimate(z_t, time):
    return call(z_t, time, jax.lax.stop_gradient(estimate(call(z_t, time))))

  if key is None:
    return with_estimate
  return lambda z_t, time: jax.lax.cond(
    jax.random.bernoulli(key), with_estimate, lambda z, t: call(z, t), z_t, time
  )


def _reader(config: ml_collections.ConfigDict, positions: Optional[jax.Array]):
  """z -> the tokens the network reads: z itself, or shifted (config.model.shifted_prediction)."""
  if not config.model.shifted_prediction:
    return lambda tokens: tokens
  return lambda tokens: ar_inputs(tokens, config.data.vocab_size, positions)


def _hide(hidden, mask_id: int):
  """tokens -> tokens with the hidden positions masked (the identity without any)."""
  if hidden is None:
    return lambda tokens: tokens
  return lambda tokens: jnp.where(hidden, mask_id, tokens).astype(tokens.dtype)


def training_mask_rates(config: ml_collections.ConfigDict) -> Optional[tuple]:
  """config.training.mask_rates as (β, ω), or None for the whole range."""
  if not config.training.mask_rates:
    return None
  low, high = (float(v) for v in config.training.mask_rates.split(","))
  return (low, high)


def dropped_prompts(batch: dict, key, p: float, row_index: jax.Array) -> jax.Array:
  """[B, L] bool: the prompt positions (read, never scored: not editable, not padding) of the
  rows whose prompt is dropped, each with probability p (classifier-free guidance's
  unconditional model). A row's draw depends on its global index."""
  editable = batch["editable"].astype(bool)
  segments = batch["segment_ids"]
  prompt = ~editable if segments is None else ~editable & (segments != 0)
  rows = jax.vmap(jax.random.fold_in, (None, 0))(key, row_index)
  dropped = jax.vmap(jax.random.uniform)(rows) < p
  return prompt & dropped[:, None]


def sampling_denoiser(
  model,
  params,
  config: ml_collections.ConfigDict,
  segment_ids: Optional[jax.Array] = None,
  positions: Optional[jax.Array] = None,
) -> Denoiser:
  """The samplers' `Denoiser` of the model: called with α (t for a state-dependent schedule);
  a network conditioned on t (config.model.time_input = "t") gets schedule.time_of(α), t to
  within the rounding of α; an ar model and a shifted mdm read [BOS, z_0, ..., z_{L-2}].
  segment_ids and positions [B, L] (as in a batch): rows that end in padding, which the real
  tokens never attend to. A self-conditioned network reads its own first call's estimate of
  the same z unless the sampler passes one (`Denoiser`'s passes=2)."""
  schedule = schedule_of(params, config)
  time_input = "alpha" if schedule.state_dependent else config.model.time_input
  shifted = config.model.type == "ar" or config.model.shifted_prediction
  inputs = None
  if segment_ids is not None or positions is not None:
    inputs = {"segment_ids": segment_ids, "positions": positions}
  return Denoiser.of_network(
    model,
    network_params(params),
    shift_id=config.data.vocab_size if shifted else None,
    time_of=None if time_input == "alpha" else schedule.time_of,
    inputs=inputs,
  )


def sequence_nats(
  params,
  batch: dict,
  key,
  *,
  model,
  config: ml_collections.ConfigDict,
  estimator: str,
  t_sampling: str,
  num_steps: Optional[int] = None,
  row_index: Optional[jax.Array] = None,
  num_rows: Optional[int] = None,
  draws: Optional[dict] = None,
  hidden: Optional[jax.Array] = None,
  mask_rates: Optional[tuple] = None,
  attention_mask: Optional[jax.Array] = None,
  self_condition_key: Optional[jax.Array] = None,
) -> jax.Array:
  """Per-row loss in nats [B] over the editable tokens: a NELBO draw (mdm) or the exact NLL (ar).

  row_index [B] and num_rows place the rows in their global batch (default:
  the batch is the global batch), so a row's draws do not depend on how the
  batch is split (`bounds.nelbo`). draws ({"t": [B], "masked": [B, L]}, mdm) replay
  given times and masks instead of drawing them (`bounds.nelbo`). hidden [B, L] (mdm): non-editable
  positions the network sees masked. mask_rates (β, ω): BD3-LM's clipped schedule
  (`bounds.nelbo`). attention_mask [L, L] (mdm): the network's extra attention pattern.
  self_condition_key: a training step's coin of a self-conditioned network (`denoiser`).
  """
  tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
  editable = batch["editable"].astype(bool)
  vocab_size = config.data.vocab_size
  if config.model.type == "ar":
    if draws is not None:
      raise ValueError("draws replay a diffusion loss's times and masks; the ar model has none.")
    inputs = ar_inputs(tokens, vocab_size, positions)
    logits = model.apply({"params": params}, inputs, None, segments, positions)
    return jnp.where(editable, bounds.cross_entropy(logits, tokens), 0.0).sum(-1)
  block_size = model.block_size or None
  uniform_blocks = block_size and config.diffusion.process == "uniform"
  if uniform_blocks and estimator == "standard" and num_steps is None and draws is None:
    if hidden is not None:  # Hidden positions read the mask id, which uniform noise lacks.
      raise ValueError("hidden positions need the masked process (a mask id to show them as).")
    network = network_params(params)
    return uniform.one_pass_block_nelbo(
      key,
      lambda z, x, keep: model.apply({"params": network}, z, keep, segments, positions, x),
      tokens,
      schedule_of(params, config),
      block_size,
      editable=editable,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
    )
  if block_size and not uniform_blocks and estimator == "standard" and num_steps is None:
    network, shown = network_params(params), _hide(hidden, vocab_size)
    return blocks.one_pass_nelbo(
      key,
      lambda z, x: model.apply({"params": network}, shown(z), None, segments, positions, shown(x)),
      tokens,
      schedule_of(params, config),
      block_size,
      mask_id=vocab_size,
      editable=editable,
      t_sampling=t_sampling,
      row_index=row_index,
      num_rows=num_rows,
      endpoint_terms=config.diffusion.endpoint_terms,
      block_draws=draws,
      mask_rates=mask_rates,
    )
  denoise_fn = denoiser(
    model,
    params,
    batch,
    hidden,
    config=config,
    attention_mask=attention_mask,
    self_condition_key=self_condition_key,
  )
  return bounds.nelbo(
    key,
    denoise_fn,
    tokens,
    schedule_of(params, config),
    mask_id=vocab_size,
    editable=editable,
    process=config.diffusion.process,
    estimator=estimator,
    t_sampling=t_sampling,
    num_steps=num_steps,
    row_index=row_index,
    num_rows=num_rows,
    reconstruction_time=config.diffusion.reconstruction_time,
    time_input=config.model.time_input,
    endpoint_terms=config.diffusion.endpoint_terms,
    draws=draws,
    block_size=block_size,
    mask_rates=mask_rates,
  )


def training_loss(
  params,
  batch: dict,
  key,
  *,
  model,
  config: ml_collections.ConfigDict,
  row_index: jax.Array,
  num_rows: int,
  draws: Optional[dict] = None,
  attention_mask: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
  """(loss to differentiate [B], NELBO draw [B]): equal in value; for a learned schedule the
  first also carries the score-function gradient of its exponents (`md4jax.diffusion.genmd4`).
  draws: replayed times and masks (`sequence_nats`). With training.prompt_dropout p, each row's
  prompt is hidden from the network with probability p (`dropped_prompts`). attention_mask
  [L, L]: the network's extra attention pattern (`adaptation.annealed_attention`). A
  self-conditioned network reads its first pass's estimate on half the steps (`denoiser`)."""
  hidden = None
  if config.training.prompt_dropout > 0:
    key, dropout_key = jax.random.split(key)
    hidden = dropped_prompts(batch, dropout_key, config.training.prompt_dropout, row_index)
  self_condition_key = None
  if config.model.self_condition:
    key, self_condition_key = jax.random.split(key)
  if not is_learned(config) or config.model.type == "ar":
    nats = sequence_nats(
      params,
      batch,
      key,
      model=model,
      config=config,
      estimator=config.training.estimator,
      t_sampling="stratified",
      row_index=row_index,
      num_rows=num_rows,
      draws=draws,
      hidden=hidden,
      mask_rates=training_mask_rates(config),
      attention_mask=attention_mask,
      self_condition_key=self_condition_key,
    )
    return nats, nats
  if draws is not None:
    raise ValueError("draws replay a mask-rate schedule's training loss, not a learned schedule's.")
  nats, surrogate = bounds.nelbo_surrogate(
    key,
    denoiser(model, params, batch, hidden, config=config, attention_mask=attention_mask),
    batch["tokens"],
    schedule_of(params, config),
    mask_id=config.data.vocab_size,
    editable=batch["editable"].astype(bool),
    gradient=config.diffusion.exponent_gradient,
    row_index=row_index,
    num_rows=num_rows,
    reconstruction_time=config.diffusion.reconstruction_time,
  )
  return surrogate, nats
