"""Generation past the model's context, MDLM style: windows sampled one after another, each
with the end of the previous one as its clamped prefix (`md4jax.sampling.samplers` samples each window)."""

from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.sampling import samplers

Array = jax.Array


def generate_semi_autoregressive(
  key: Array,
  denoise_fn,
  *,
  batch_size: int,
  total_length: int,
  context_length: int,
  block_length: int,
  schedule,
  mask_id: int,
  prompt: Optional[Array] = None,
  eos_id: Optional[int] = None,
  method: str = "ancestral",
  **sample_kwargs,
):
  """Generates past the model's context, MDLM style, block by block.

  The first window of `context_length` tokens is sampled from all-mask (with
  the prompt, a prefix [P] or [B, P], clamped). Each later window keeps the
  last context_length − block_length tokens as a clamped prefix and samples
  `block_length` new ones. With `eos_id`, generation stops once every sequence
  has an EOS, and tokens after a sequence's first EOS are set to EOS.
  `sample_kwargs` go to `sample` (method, num_steps, temperature, ...).

  Returns:
    (tokens [B, total_length] int32, info) with info["nfe"] (all blocks),
    info["num_blocks"] and info["lengths"] [B] (up to and including the first EOS).
  """
  if not 0 < block_length <= context_length:
    raise ValueError(
      f"Need 0 < block_length <= context_length, got {block_length}, {context_length}."
    )
  if total_length < 1:
    raise ValueError(f"total_length must be >= 1, got {total_length}.")
  if sample_kwargs.get("guidance_scale") and total_length > context_length:
    # A later window's clamped prefix is generated text, not the prompt guidance contrasts.
    raise ValueError(
      "guidance_scale past the context: the later windows hold no prompt to contrast with "
      "(block diffusion's sampler guides past the context)."
    )
  window = min(context_length, total_length)
  prefix = jnp.zeros((batch_size, 0), jnp.int32)
  if prompt is not None:
    prefix = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (batch_size, jnp.shape(prompt)[-1]))
    if prefix.shape[1] > window:
      raise ValueError(
        f"The prompt ({prefix.shape[1]} tokens) is longer than the window ({window})."
      )

  @jax.jit
  def sample_window(window_key, given, given_mask):
    return samplers.sample(
      window_key,
      denoise_fn,
      batch_size=batch_size,
      length=window,
      schedule=schedule,
      mask_id=mask_id,
      prompt=given,
      prompt_mask=given_mask,
      method=method,
      **sample_kwargs,
    )

  def clamped(known):  # Window with `known` as its prefix and masks after it.
    pad = window - known.shape[1]
    given = jnp.concatenate([known, jnp.full((batch_size, pad), mask_id, jnp.int32)], axis=1)
    return given, jnp.arange(window) < known.shape[1]

  tokens, info = sample_window(jax.random.fold_in(key, 0), *clamped(prefix))
  samplers.check_logits(info, method)
  nfe, num_blocks = int(info["nfe"]), 1
  keep = window - block_length
  while tokens.shape[1] < total_length:
    if eos_id is not None and bool(jnp.all(jnp.any(tokens == eos_id, axis=1))):
      break
    new, info = sample_window(
      jax.random.fold_in(key, num_blocks), *clamped(tokens[:, tokens.shape[1] - keep :])
    )
    samplers.check_logits(info, method)
    tokens = jnp.concatenate([tokens, new[:, keep:]], axis=1)
    nfe, num_blocks = nfe + int(info["nfe"]), num_blocks + 1
  tokens = tokens[:, :total_length]
  lengths = jnp.full((batch_size,), tokens.shape[1], jnp.int32)
  if eos_id is not None:
    is_eos = tokens == eos_id
    lengths = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, lengths)
    tokens = jnp.where(jnp.arange(tokens.shape[1]) >= lengths[:, None], eos_id, tokens)
    if tokens.shape[1] < total_length:  # Stopped early: pad with EOS.
      tokens = jnp.pad(
        tokens, ((0, 0), (0, total_length - tokens.shape[1])), constant_values=eos_id
      )
  return tokens, {"nfe": nfe, "num_blocks": num_blocks, "lengths": lengths}
