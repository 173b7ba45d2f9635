"""Block-wise decoding of a bidirectional masked diffusion model with Fast-dLLM's approximate KV
caches (Wu et al. 2025): the sequence is revealed block after block, each block by any method of
`sample`, and at the start of each block one call on the whole sequence refreshes every layer's
keys and values.

  cache="none"    every call runs the whole sequence (exact block-wise decoding: the reference).
  cache="prefix"  a call runs the block alone and reads the cached keys and values of the
                  positions before it.
  cache="dual"    also those after it (still masked, or a prompt).

The cached keys and values were computed when the block was all masked; a bidirectional network
would compute them anew as the block is revealed, so prefix and dual approximate "none". What
that costs in bits is measured against "none", on the same keys (`benchmarks/leaderboard.py`).
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.sampling import block_sampler, samplers

Array = jax.Array
CACHES = ("none", "prefix", "dual")


@functools.lru_cache(maxsize=8)  # Bounded: each entry holds a compiled loop.
def _compiled_loop(
  model, schedule, mask_id: int, method: str, cache: str, guidance: float, shape, settings
):
  """Under guidance every call, the refresh too, runs the doubled batch [rows; rows with the
  prompt masked]: the prompt-masked rows keep a cache of their own."""
  batch_size, block_size, num_blocks = shape
  rows = 2 * batch_size if guidance else batch_size
  length = block_size * num_blocks
  everywhere = jnp.broadcast_to(jnp.arange(length), (rows, length))
  alpha_one = jnp.ones((batch_size,), jnp.float32)  # Unused by the time-free network.
  head_dim = model.model_dim // model.num_heads
  empty_shape = (model.num_layers, rows, 0, model.num_heads, head_dim)

  sampler = dict(
    batch_size=batch_size, schedule=schedule, mask_id=mask_id, method=method, **dict(settings)
  )

  def run(key, params, tokens, given):
    def one_block(block, carry):
      tokens, nfe, broken = carry
      start = block * block_size
      inside = (jnp.arange(length) >= start) & (jnp.arange(length) < start + block_size)
      positions = jnp.broadcast_to(start + jnp.arange(block_size), (rows, block_size))
      prompt_in_block = jax.lax.dynamic_slice_in_dim(given, start, block_size)

      def doubled(z, alpha, prompt):
        return samplers.with_prompt_masked(z, alpha, prompt, mask_id) if guidance else (z, alpha)

      def mixed(logits):
        return samplers.mix_guidance(logits, guidance) if guidance else logits

      if cache == "none":

        def denoise_fn(z, alpha):
          full = jax.lax.dynamic_update_slice_in_dim(tokens, z, start, axis=1)
          logits = mixed(model.apply({"params": params}, *doubled(full, alpha, given)))
          return jax.lax.dynamic_slice_in_dim(logits, start, block_size, axis=1)

        refresh_calls = 0
      else:
        # No cached position: the whole sequence reads itself, and every layer's keys and
        # values come back.
        none_cached = jnp.zeros(empty_shape, model.dtype)
        empty = {"k": none_cached, "v": none_cached, "valid": jnp.zeros((0,), bool)}
        _, kv = model.apply(
          {"params": params},
          *doubled(tokens, alpha_one, given),
          positions=everywhere,
          cache=empty,
        )
        valid = jnp.arange(length) < start if cache == "prefix" else ~inside
        cached = {"k": kv["k"], "v": kv["v"], "valid": valid}

        def denoise_fn(z, alpha):
          z, alpha = doubled(z, alpha, prompt_in_block)
          return mixed(
            model.apply({"params": params}, z, alpha, positions=positions, cache=cached)[0]
          )

        refresh_calls = 1
      tokens, _, nfe, broken = block_sampler.sample_block(
        key, block, denoise_fn, tokens, given, nfe, broken, block_size, sampler
      )
      return tokens, nfe + refresh_calls, broken

    carry = (tokens, jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32))
    return jax.lax.fori_loop(0, num_blocks, one_block, carry)

  return jax.jit(run)


def sample_with_cache(
  key: Array,
  model,
  params,
  *,
  batch_size: int,
  length: int,
  block_size: int,
  cache: str,
  schedule,
  mask_id: int,
  prompt: Optional[Array] = None,
  method: str = "ancestral",
  guidance_scale: float = 0.0,
  **sample_kwargs,
):
  """Block-wise decoding of `length` tokens (a multiple of block_size, within the model's
  context) from a time-free bidirectional Transformer with `cache` (CACHES). prompt: a prefix
  [P] or [B, P], clamped. guidance_scale: w of classifier-free guidance (the unconditional
  rows mask the prompt everywhere, and keep their own cache). sample_kwargs go to `sample` for
  every block.

  Returns (tokens [B, length] int32, info): info["nfe"] every network call, the refresh calls
  included, and info["num_blocks"].
  """
  if cache not in CACHES:
    raise ValueError(f"Unknown cache {cache!r}; valid: {', '.join(CACHES)}.")
  if block_size < 1 or length % block_size:
    raise ValueError(f"block_size must divide length {length}, got {block_size}.")
  if model.block_size or model.causal or model.time_conditioning != "none":
    raise ValueError(
      "Approximate caching is for a time-free bidirectional masked diffusion model; this one "
      f"has block_size={model.block_size}, causal={model.causal}, time_conditioning="
      f"{model.time_conditioning!r}."
    )
  num_blocks = length // block_size
  tokens, given = block_sampler.prompt_arrays(prompt, batch_size, length, mask_id)
  settings = (
    model,
    schedule,
    mask_id,
    method,
    cache,
    block_sampler.checked_guidance(guidance_scale, prompt),
    (batch_size, block_size, num_blocks),
    tuple(sorted(sample_kwargs.items())),
  )
  tokens, nfe, broken = block_sampler.compiled(_compiled_loop, settings)(key, params, tokens, given)
  info = {"nfe": nfe, "num_blocks": num_blocks, "nonfinite_call": broken}
  samplers.check_logits(info, method)
  return tokens, info
