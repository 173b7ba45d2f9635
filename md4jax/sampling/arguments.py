"""The block decoder's argument checks (`md4jax.sample`): the blocks and their context, the block
offset, the key and row offset, the cache strategy against the denoiser (and its inputs) it is
asked to serve, and the prompt. Each raises ValueError (a
shape: chex's AssertionError) naming the argument; the sampler settings are
`samplers.check_settings`'. `check_filled` checks a sample's info after it (a traced prompt's
positions before the block offset)."""

import math
import numbers
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion.denoiser import Denoiser

CACHES = ("none", "exact", "prefix", "dual")
INPUTS = {"segment_ids", "positions"}  # A Denoiser's per-row inputs the decoder reads.


def check_blocks(
  length: int, block_size: Optional[int], context_length: Optional[int], block_offset: int = 0
) -> tuple[int, int, int]:
  """(block_size, num_blocks, window): blocks of block_size (default: the length after
  block_offset, one block) tiling [block_offset, length), and the positions a call of cache
  "none" reads (context_length, at most the padded sample)."""
  if not (isinstance(block_offset, numbers.Integral) and not isinstance(block_offset, bool)):
    raise ValueError(f"sample: block_offset must be an integer, got {block_offset!r}.")
  if not (isinstance(length, numbers.Integral) and 0 <= block_offset < length):
    raise ValueError(
      f"sample: block_offset must lie in [0, length={length}) (the prompt's width), "
      f"got {block_offset}."
    )
  block_size = length - block_offset if block_size is None else block_size
  integers = all(
    isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (length, block_size)
  )
  if not (integers and length >= 1 and block_size >= 1):
    raise ValueError(f"sample: need length >= 1 and block_size >= 1, got {length}, {block_size}.")
  length, block_size = int(length), int(block_size)
  num_blocks = math.ceil((length - block_offset) / block_size)
  padded = block_offset + num_blocks * block_size
  if context_length is not None and (context_length < block_size or context_length % block_size):
    raise ValueError(
      f"sample: context_length must be a multiple of block_size {block_size}, got {context_length}."
    )
  return block_size, num_blocks, padded if context_length is None else min(context_length, padded)


def check_block_offset(block_offset: int, cache: str, prompt):
  """block_offset (already in [0, length): `check_blocks`) starts the blocks after a prompt at
  least that wide, with cache none, prefix or dual."""
  if not block_offset:
    return
  if cache == "exact":
    raise ValueError(
      f"sample: block_offset={block_offset} takes cache none, prefix or dual; the exact cache's "
      "blocks are the network's own, from position 0 (got cache='exact')."
    )
  if prompt is None:
    raise ValueError(
      f"sample: block_offset={block_offset} starts the blocks after the prompt, and no prompt is "
      f"given; give one at least {block_offset} wide."
    )
  width = np.shape(prompt)[-1]
  if width < block_offset:
    raise ValueError(
      f"sample: block_offset={block_offset} starts the blocks after a prompt at least that wide; "
      f"the prompt is {width} wide."
    )


def check_given_before_offset(prompt, prompt_mask, mask_id: int, block_offset: int):
  """Every position before block_offset is given (checked when the prompt is concrete; a traced
  one: `check_filled` of the sample's info)."""
  if not block_offset:
    return
  shown = np.asarray(prompt)[..., :block_offset] != mask_id
  if prompt_mask is not None:
    shown &= np.asarray(prompt_mask, bool)[..., :block_offset]
  if not shown.all():
    raise ValueError(
      f"sample: block_offset={block_offset}, but the prompt leaves positions before it masked, "
      "which no block would sample."
    )


def check_filled(info: dict):
  """Raises ValueError if a sample (its host info) left positions before block_offset masked:
  they were not given, no block samples them, and they hold the mask id. `sample` checks a
  concrete prompt before sampling; inside a caller's jit, call this on the info after it."""
  unfilled = info.get("unfilled")
  if unfilled is not None and np.sum(np.asarray(unfilled)) > 0:
    raise ValueError(
      f"sample: {int(np.sum(np.asarray(unfilled)))} positions before block_offset were neither "
      "given by the prompt nor sampled by a block: they hold the mask id."
    )


def check_decoding(
  denoiser: Denoiser,
  *,
  cache: str,
  guidance_scale: float,
  record_trajectory: bool,
  num_blocks: int,
  eos_id: Optional[int],
  mask_id: int,
):
  """What the decoder takes besides the blocks: guidance, the trajectory, EOS."""
  if cache != "none" and guidance_scale and denoiser.shift_id is not None:
    raise ValueError("sample: guidance of a shifted denoiser takes cache='none'.")
  if record_trajectory and num_blocks > 1:
    raise ValueError("sample: record_trajectory records one block; leave block_size unset.")
  if eos_id is not None and not 0 <= eos_id < mask_id:
    raise ValueError(f"sample: eos_id must be a token id in [0, {mask_id}), got {eos_id}.")


def check_key(key):
  """`key` is one PRNG key: a typed key of shape () or a raw uint32 key of shape [2]."""
  typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  shape = jnp.shape(key)
  if not (shape == () if typed else len(shape) == 1 and jnp.asarray(key).dtype == jnp.uint32):
    raise ValueError(
      f"sample: key must be one PRNG key (jax.random.key or PRNGKey), got shape {shape}; rows "
      "of a larger request take row_offset."
    )


def check_row_offset(row_offset):
  """row_offset as an int32 scalar: an integer in [0, 2^31), or a traced integer scalar."""
  if isinstance(row_offset, jax.core.Tracer):
    if jnp.shape(row_offset) or not jnp.issubdtype(row_offset.dtype, jnp.integer):
      raise ValueError(f"sample: row_offset must be an integer scalar, got {row_offset}.")
    return row_offset.astype(jnp.int32)
  value = np.asarray(row_offset)
  integer = np.issubdtype(value.dtype, np.integer) and value.shape == ()
  if not (integer and 0 <= int(value) < 2**31):
    raise ValueError(f"sample: row_offset must be an integer >= 0, got {row_offset!r}.")
  return jnp.asarray(int(value), jnp.int32)


def check_inputs(denoiser: Denoiser, cache: str, batch_size: int, length: int):
  """A Denoiser's inputs are {"segment_ids", "positions"} [1 or B, length] of a network, read
  by cache "none" only."""
  inputs = denoiser.inputs
  if inputs is None:
    return
  if denoiser.network is None:
    raise ValueError("sample: a Denoiser's inputs are read by a network (Denoiser.of_network).")
  if not isinstance(inputs, dict) or not inputs or set(inputs) - INPUTS:
    raise ValueError(
      f"sample: a Denoiser's inputs must be a dict of {', '.join(sorted(INPUTS))}, got "
      f"{sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__}."
    )
  if cache != "none":
    raise ValueError(
      f"sample: a Denoiser's per-row inputs (segment_ids, positions) are read with cache='none' "
      f"only, got cache={cache!r}."
    )
  for name, value in inputs.items():
    shape = jnp.shape(value)
    if len(shape) != 2 or shape[0] not in (1, batch_size) or shape[1] != length:
      raise ValueError(
        f"sample: the Denoiser's inputs[{name!r}] must be [1 or batch_size={batch_size}, "
        f"length={length}], got {shape}."
      )
    if not jnp.issubdtype(jnp.asarray(value).dtype, jnp.integer):
      raise ValueError(f"sample: the Denoiser's inputs[{name!r}] must hold integers.")


def check_prompt_shape(prompt, prompt_mask, batch_size: int, length: int):
  """prompt and prompt_mask are [P] or [1 or B, P], P <= length, of one width."""
  for name, given in (("prompt", prompt), ("prompt_mask", prompt_mask)):
    if given is None:
      continue
    message = f"sample: {name} must be [P] or [batch_size, P] with P <= length {length}"
    chex.assert_rank(given, {1, 2}, custom_message=message)
    chex.assert_axis_dimension_lteq(given, -1, length, custom_message=message)
    if jnp.ndim(given) == 2 and jnp.shape(given)[0] not in (1, batch_size):
      raise ValueError(
        f"sample: {name} has {jnp.shape(given)[0]} rows; give 1 or batch_size={batch_size}."
      )
  if prompt_mask is not None:
    chex.assert_axis_dimension(
      prompt_mask,
      -1,
      jnp.shape(prompt)[-1],
      custom_message="sample: prompt_mask must have the prompt's width",
    )


def check_prompt(prompt, prompt_mask, mask_id: int):
  """Given positions must hold clean ids (checked when the prompt is concrete)."""
  ids = np.asarray(prompt)
  given = ids != mask_id if prompt_mask is None else np.asarray(prompt_mask, bool)
  given = np.broadcast_to(given, np.broadcast_shapes(given.shape, ids.shape))
  ids = np.broadcast_to(ids, given.shape)
  if np.any((ids < 0) | (ids > mask_id)):
    raise ValueError(
      f"sample: prompt ids must be in [0, {mask_id}] (the mask id {mask_id} marks a "
      f"position to fill), got ids from {ids.min()} to {ids.max()}."
    )
  if np.any(given & (ids == mask_id)):
    raise ValueError(
      "sample: prompt_mask marks a position whose prompt id is the mask id; a given "
      "position must hold a clean token."
    )


def check_cache(cache: str, denoiser: Denoiser, block_size: int, plan_window: int, padded: int):
  """The cache strategy serves this denoiser (the module docstring)."""
  if cache not in CACHES:
    raise ValueError(f"sample: Unknown cache {cache!r}; valid: {', '.join(CACHES)}.")
  if cache == "none":
    if denoiser.shift_id is not None and plan_window < padded:
      raise ValueError(
        "sample: a shifted denoiser reads the token before each window's first position; past "
        "the context, decode it with cache='exact'."
      )
    if denoiser.shifts_logits and plan_window == block_size < padded:
      raise ValueError(
        f"sample: the network's shift_logits takes a block's first logits from the position "
        f"before it, which a window of context_length = block_size = {block_size} leaves out; "
        "give a context_length larger than block_size."
      )
    return
  if denoiser.shifts_logits:
    raise ValueError(
      f"sample: cache={cache!r} runs each block alone, but the network's shift_logits (Dream's "
      "shift) takes a block's first logits from the position before it; use cache='none'."
    )
  if denoiser.self_conditioned:
    raise ValueError(
      f"sample: cache={cache!r}: a self-conditioned network reads its estimate of x_0 in every "
      "call, which a cached block call does not pass; use cache='none'."
    )
  layout = denoiser.cache_layout
  if layout is None:
    raise ValueError(
      f"sample: cache={cache!r} caches a network's keys and values; give a Denoiser of a "
      "network without per-row inputs (md4jax.Denoiser.of_network), not a plain function."
    )
  if cache == "exact":
    if layout.block_size and layout.block_size != block_size:
      raise ValueError(
        f"sample: cache='exact': the network reads blocks of {layout.block_size} tokens; "
        f"block_size is {block_size}."
      )
    if not (layout.block_size or layout.causal):
      raise ValueError(
        "sample: cache='exact' needs a network whose blocks never read later ones (block-causal "
        "or causal); a bidirectional one takes cache='prefix' or 'dual' (approximate) or 'none'."
      )
    return
  network = denoiser.network
  if layout.block_size or layout.causal or network.time_conditioning != "none":
    raise ValueError(
      f"sample: cache={cache!r} (approximate caching) is for a time-free bidirectional masked "
      f"diffusion network; this one has block_size={layout.block_size}, causal={layout.causal}, "
      f"time_conditioning={network.time_conditioning!r}."
    )
  if denoiser.shift_id is not None:
    raise ValueError(f"sample: cache={cache!r} serves an unshifted denoiser; use 'none'.")
  if plan_window < padded:
    raise ValueError(
      f"sample: cache={cache!r} decodes within the context: context_length {plan_window} is "
      f"shorter than the {padded} positions sampled."
    )
