"""Block diffusion's sampler (BD3-LM): blocks of b tokens generated one after another, each by any
of `sample`'s methods given the clean blocks before it, so generation has no length limit.

Two paths that draw the same tokens on the same key:
  `sample_blocks`: the reference, over any denoise_fn(z, alpha) (the exact oracle too): block
    k's calls run the denoiser on the clean blocks before it, the noisy block and the later
    positions masked, and read the block's logits; past the context, on a window of
    context_length tokens ending with the block (the window re-run at every call).
  `sample_blocks_cached`: a block-causal `Transformer` (block_size > 0) with an exact KV cache:
    each finished block's keys and values are computed once, in one extra call on the clean
    block, and every later call reads them; a call runs the network on b tokens, not on the
    window. Past the context the cache is a sliding window of the last context_length − b
    tokens (a ring of whole blocks); their keys and values are the ones computed when each
    block was written, with the context it had then.
"""

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from md4jax.sampling import samplers

Array = jax.Array


def prompt_arrays(prompt, batch_size: int, padded_length: int, mask_id: int):
  """(tokens [B, K b] with the prompt, masks after it; given [K b] bool)."""
  tokens = jnp.full((batch_size, padded_length), mask_id, jnp.int32)
  given = np.zeros(padded_length, bool)
  if prompt is not None:
    prompt = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (batch_size, jnp.shape(prompt)[-1]))
    if prompt.shape[1] > padded_length:
      raise ValueError(f"The prompt ({prompt.shape[1]} tokens) is longer than the sample.")
    tokens = tokens.at[:, : prompt.shape[1]].set(prompt)
    given[: prompt.shape[1]] = True
  return tokens, jnp.asarray(given)


def _check(length: int, block_size: int, context_length: Optional[int]) -> int:
  """The number of blocks; refuses shapes the sampler cannot run."""
  if block_size < 1 or length < 1:
    raise ValueError(f"Need block_size >= 1 and length >= 1, got {block_size}, {length}.")
  if context_length is not None and (context_length < block_size or context_length % block_size):
    raise ValueError(
      f"context_length must be a multiple of block_size {block_size}, got {context_length}."
    )
  return math.ceil(length / block_size)


@functools.lru_cache(maxsize=8)  # Bounded: each entry holds its denoiser.
def _compiled_window_loop(
  denoise_fn, schedule, mask_id: int, method: str, guidance: float, shape, settings
):
  """The reference's jitted loop fn(key, tokens, given) for one shape (batch_size, block_size,
  num_blocks, window)."""
  batch_size, block_size, num_blocks, window = shape
  columns = jnp.arange(window)

  sampler = dict(
    batch_size=batch_size, schedule=schedule, mask_id=mask_id, method=method, **dict(settings)
  )

  def run(key, tokens, given):
    def one_block(block, carry):
      tokens, nfe, broken = carry
      start, end = block * block_size, (block + 1) * block_size
      first = jnp.maximum(end - window, 0)  # The window's first position.
      shown = jax.lax.dynamic_slice_in_dim(tokens, first, window, axis=1)
      # Later blocks are masked (a prompt reaching into them is not shown yet).
      shown = jnp.where(first + columns < end, shown, mask_id)
      offset = start - first

      def block_denoiser(z, alpha):
        window_z = jax.lax.dynamic_update_slice_in_dim(shown, z, offset, axis=1)
        if guidance:  # The unconditional half masks every prompt position in the window.
          prompt_in_window = jax.lax.dynamic_slice_in_dim(given, first, window)
          both = denoise_fn(
            *samplers.with_prompt_masked(window_z, alpha, prompt_in_window, mask_id)
          )
          logits = samplers.mix_guidance(both, guidance)
        else:
          logits = denoise_fn(window_z, alpha)
        return jax.lax.dynamic_slice_in_dim(logits, offset, block_size, axis=1)

      tokens, new, nfe, broken = sample_block(
        key, block, block_denoiser, tokens, given, nfe, broken, block_size, sampler
      )
      return tokens, nfe, broken

    carry = (tokens, jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32))
    return jax.lax.fori_loop(0, num_blocks, one_block, carry)

  return jax.jit(run)


def sample_block(key, block, denoise_fn, tokens, given, nfe, broken, block_size: int, sampler):
  """Block `block` of tokens [B, K b] sampled by `sample` (sampler: its other arguments) through
  denoise_fn on the block's b positions, its prompt positions (given) clamped: (tokens with the
  block, the block, calls so far, the first broken call or −1)."""
  start = block * block_size
  new, info = samplers.sample(
    jax.random.fold_in(key, block),
    denoise_fn,
    length=block_size,
    prompt=jax.lax.dynamic_slice_in_dim(tokens, start, block_size, axis=1),
    prompt_mask=jax.lax.dynamic_slice_in_dim(given, start, block_size),
    **sampler,
  )
  broken = jnp.where(
    (broken < 0) & (info["nonfinite_call"] >= 0), nfe + info["nonfinite_call"], broken
  )
  tokens = jax.lax.dynamic_update_slice_in_dim(tokens, new, start, axis=1)
  return tokens, new, nfe + info["nfe"], broken


def compiled(builder, settings: tuple):
  """builder(*settings), an lru_cached compile, or a fresh one for unhashable settings."""
  try:
    return builder(*settings)
  except TypeError:  # An unhashable setting: compile for this call only.
    return builder.__wrapped__(*settings)


def sample_blocks(
  key: Array,
  denoise_fn,
  *,
  batch_size: int,
  length: int,
  block_size: int,
  schedule,
  mask_id: int,
  context_length: Optional[int] = None,
  prompt: Optional[Array] = None,
  method: str = "ancestral",
  guidance_scale: float = 0.0,
  **sample_kwargs,
):
  """Block after block, each block's calls running denoise_fn on a window of context_length
  tokens (None: the whole sample) that ends with the block: the clean prefix, the noisy block,
  and any later positions masked. prompt: a prefix [P] or [B, P], clamped. guidance_scale: w of
  classifier-free guidance, whose unconditional call masks the prompt wherever it is in the
  window. sample_kwargs go to `sample` for every block (num_steps, temperature, ...). One
  compiled loop, kept for the next call with the same denoiser, shape and settings.

  Returns (tokens [B, length] int32, info): info["nfe"] the denoiser calls, info["num_blocks"].
  """
  num_blocks = _check(length, block_size, context_length)
  padded = num_blocks * block_size
  tokens, given = prompt_arrays(prompt, batch_size, padded, mask_id)
  window = padded if context_length is None else min(context_length, padded)
  shape = (batch_size, block_size, num_blocks, window)
  guidance = checked_guidance(guidance_scale, prompt)
  kwargs = tuple(sorted(sample_kwargs.items()))
  settings = (denoise_fn, schedule, mask_id, method, guidance, shape, kwargs)
  tokens, nfe, broken = compiled(_compiled_window_loop, settings)(key, tokens, given)
  info = {"nfe": nfe, "num_blocks": num_blocks, "nonfinite_call": broken}
  samplers.check_logits(info, method)
  return tokens[:, :length], info


def checked_guidance(guidance_scale, prompt) -> float:
  """guidance_scale, checked as `sample` checks it."""
  if not guidance_scale >= 0:
    raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}.")
  if guidance_scale and prompt is None:
    raise ValueError(
      "guidance_scale needs a prompt: guidance contrasts the prompt with the prompt masked."
    )
  return float(guidance_scale)


def cache_bytes(
  model, batch_size: int, context_length: int, block_size: int, guided: bool = False
) -> int:
  """Bytes of `sample_blocks_cached`'s KV cache: keys and values of every layer (twice over
  under guidance: the prompt-masked rows have a cache of their own)."""
  head_dim = model.model_dim // model.num_heads
  slots = context_length - block_size
  itemsize = jnp.dtype(model.dtype).itemsize
  rows = 2 * batch_size if guided else batch_size
  return 2 * model.num_layers * rows * slots * model.num_heads * head_dim * itemsize


@functools.lru_cache(maxsize=8)  # Bounded: each entry holds a compiled loop.
def _compiled_loop(
  model, schedule, mask_id: int, method: str, guidance: float, shape: tuple, settings: tuple
):
  """The cached sampler's jitted loop fn(key, params, tokens, given) for one shape
  (batch_size, block_size, num_blocks, slots) and `sample`'s other settings. Under guidance
  every call runs the doubled batch [rows; rows with the prompt masked], and the cache holds
  both halves' keys and values: the prompt-masked rows' cache is the unconditional model's."""
  batch_size, block_size, num_blocks, slots = shape
  rows = 2 * batch_size if guidance else batch_size
  ring = max(slots // block_size, 1)
  clean_alpha = jnp.ones((batch_size,), jnp.float32)  # A time-conditioned network: α = 1.
  cache_shape = (
    model.num_layers,
    rows,
    slots,
    model.num_heads,
    model.model_dim // model.num_heads,
  )

  sampler = dict(
    batch_size=batch_size, schedule=schedule, mask_id=mask_id, method=method, **dict(settings)
  )

  def run(key, params, tokens, given):
    def one_block(block, carry):
      tokens, cache, nfe, broken = carry
      start = block * block_size
      positions = jnp.broadcast_to(start + jnp.arange(block_size), (rows, block_size))
      prompt_in_block = jax.lax.dynamic_slice_in_dim(given, start, block_size)

      def call(z, alpha):
        """(logits, keys and values) of z's block, both halves under guidance."""
        if guidance:
          z, alpha = samplers.with_prompt_masked(z, alpha, prompt_in_block, mask_id)
        return model.apply({"params": params}, z, alpha, positions=positions, cache=cache)

      def block_denoiser(z, alpha):
        logits = call(z, alpha)[0]
        return samplers.mix_guidance(logits, guidance) if guidance else logits

      tokens, new, nfe, broken = sample_block(
        key,
        block,
        block_denoiser,
        tokens,
        given,
        nfe,
        broken,
        block_size,
        sampler,
      )
      if slots:
        _, written = call(new, clean_alpha)
        slot = (block % ring) * block_size
        cache = {
          "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], written["k"], slot, axis=2),
          "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], written["v"], slot, axis=2),
          "valid": jax.lax.dynamic_update_slice_in_dim(
            cache["valid"], jnp.ones(block_size, bool), slot, axis=0
          ),
        }
      return tokens, cache, nfe, broken

    cache = {
      "k": jnp.zeros(cache_shape, model.dtype),
      "v": jnp.zeros(cache_shape, model.dtype),
      "valid": jnp.zeros(slots, bool),
    }
    carry = (tokens, cache, jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32))
    tokens, _, nfe, broken = jax.lax.fori_loop(0, num_blocks, one_block, carry)
    return tokens, nfe, broken

  return jax.jit(run)


def sample_blocks_cached(
  key: Array,
  model,
  params,
  *,
  batch_size: int,
  length: int,
  block_size: int,
  context_length: int,
  schedule,
  mask_id: int,
  prompt: Optional[Array] = None,
  method: str = "ancestral",
  guidance_scale: float = 0.0,
  **sample_kwargs,
):
  """`sample_blocks` for a block-causal Transformer (model.block_size == block_size), with
  the clean blocks' keys and values cached (the module docstring); one compiled loop, kept
  for the next call with the same model, shape and settings.

  Returns (tokens [B, length] int32, info): info["nfe"] the calls that sample (as
  `sample_blocks` counts them), info["cache_writes"] the calls that write the cache (one a
  block), info["num_blocks"] and info["cache_bytes"].
  """
  num_blocks = _check(length, block_size, context_length)
  if model.block_size != block_size:
    raise ValueError(
      f"The model reads blocks of {model.block_size} tokens; block_size is {block_size}."
    )
  tokens, given = prompt_arrays(prompt, batch_size, num_blocks * block_size, mask_id)
  slots = context_length - block_size  # Whole blocks: the ring never splits one.
  shape = (batch_size, block_size, num_blocks, slots)
  guidance = checked_guidance(guidance_scale, prompt)
  kwargs = tuple(sorted(sample_kwargs.items()))
  settings = (model, schedule, mask_id, method, guidance, shape, kwargs)
  tokens, nfe, broken = compiled(_compiled_loop, settings)(key, params, tokens, given)
  info = {
    "nfe": nfe,
    "cache_writes": num_blocks if slots else 0,
    "num_blocks": num_blocks,
    "cache_bytes": cache_bytes(model, batch_size, context_length, block_size, bool(guidance)),
    "nonfinite_call": broken,
  }
  samplers.check_logits(info, method)
  return tokens[:, :length], info
