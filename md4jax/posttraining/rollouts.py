"""Rollouts of a batch of prompts: pure functions around the sampler's call.

A post-training batch is a data batch ([P, L]: tokens, segment_ids, positions, editable) whose
rows are the prompts: a conditional example's prompt is its segment's non-editable tokens and
its reference answer the editable ones (the response and its EOS); a row with nothing fixed (the
generated language, text) is an unconditional prompt. Each row is repeated group_size times, the
sampler fills every position but the prompt's, and a rollout's generated span ends at its first
EOS (the sampler's `info["lengths"]`); the positions after it are padding, neither scored nor
attended to, as conditional training saw them.
"""

import jax
import jax.numpy as jnp


def grouped(batch: dict, group_size: int) -> dict:
  """Each row of batch repeated group_size times, the groups contiguous: [P · G, L]."""
  return {
    name: None if value is None else jnp.repeat(value, group_size, axis=0)
    for name, value in batch.items()
  }


def prompt_mask(batch: dict) -> jax.Array:
  """[N, L] bool: the fixed positions, a segment's tokens that are not editable."""
  editable = batch["editable"].astype(bool)
  if batch["segment_ids"] is None:  # Dense rows: one segment, every token editable.
    return ~editable
  return (batch["segment_ids"] > 0) & ~editable


def generated_span(fixed: jax.Array, lengths) -> jax.Array:
  """[N, L] bool: the positions a rollout generated, up to its first EOS (lengths [N], the
  sampler's; None: the whole row)."""
  if lengths is None:
    return ~fixed
  return ~fixed & (jnp.arange(fixed.shape[1]) < lengths[:, None])


def scored_inputs(fixed: jax.Array, span: jax.Array) -> tuple:
  """(segment_ids, positions) [N, L] of rollouts: one segment over the prompt and the generated
  span, padding (segment 0) after it."""
  segment_ids = (fixed | span).astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(fixed.shape[1], dtype=jnp.int32), fixed.shape)
  return segment_ids, positions * segment_ids
