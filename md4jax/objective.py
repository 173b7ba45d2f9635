"""The per-sequence objective of a model on a batch: training and evaluation score rows the same way.

A batch is a dict of [B, L] arrays: `tokens`, `segment_ids` (0 = padding),
`positions` and `editable` (the positions that are masked and scored: never
padding, nor a conditional example's prompt, which the model reads but never
predicts).

The AR model scores all L tokens: its input is [BOS, x_0, ..., x_{L-2}] with
BOS = vocab_size (the id the denoiser's embedding reserves for the mask, which
a causal model never sees otherwise), and its target is x. Its NLL per token is
then comparable to the diffusion NELBO per token.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections

from md4jax import diffusion
from md4jax import schedules


def ar_inputs(tokens: jax.Array, bos_id: int) -> jax.Array:
  """[BOS, x_0, ..., x_{L-2}]: position i predicts x_i from the tokens before it."""
  return jnp.concatenate([jnp.full_like(tokens[:, :1], bos_id), tokens[:, :-1]], axis=1)


def denoiser(model, params, batch: dict):
  """denoise_fn(z_t, alpha_t) -> logits of the mdm model on the batch's documents."""
  segments, positions = batch["segment_ids"], batch["positions"]
  return lambda z_t, alpha_t: model.apply({"params": params}, z_t, alpha_t, segments, positions)


def sequence_nats(params, batch: dict, key, *, model, config: ml_collections.ConfigDict,
                  estimator: str, t_sampling: str, num_steps: Optional[int] = None,
                  row_index: Optional[jax.Array] = None, num_rows: Optional[int] = None) -> jax.Array:
  """Per-row loss in nats [B] over the editable tokens: a NELBO draw (mdm) or the exact NLL (ar).

  row_index [B] and num_rows place the rows in their global batch (default:
  the batch is the global batch), so a row's draws do not depend on how the
  batch is split (`diffusion.nelbo`).
  """
  tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
  editable = batch["editable"].astype(bool)
  vocab_size = config.data.vocab_size
  if config.model.type == "ar":
    # Each document starts from BOS: a packed document never reads its predecessor's end.
    inputs = jnp.where(positions == 0, vocab_size, ar_inputs(tokens, vocab_size))
    logits = model.apply({"params": params}, inputs, None, segments, positions)
    return jnp.where(editable, diffusion.cross_entropy(logits, tokens), 0.0).sum(-1)
  return diffusion.nelbo(key, denoiser(model, params, batch), tokens,
                         schedules.get_schedule(config.diffusion.schedule), mask_id=vocab_size,
                         editable=editable, estimator=estimator, t_sampling=t_sampling,
                         num_steps=num_steps, row_index=row_index, num_rows=num_rows)
