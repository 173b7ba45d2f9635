"""The block decoder's loop (`md4jax.sample`): a `Plan`, everything static about one request, and
`decode`, which samples its blocks one after another, each network call reading what the cache
strategy gives it (`md4jax.sampling.decoder`'s docstring: the strategies and the keys)."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking, uniform
from md4jax.diffusion.denoiser import Denoiser
from md4jax.sampling import samplers, steps, uniform_state


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything but the key, the denoiser and the prompt: static, one jit cache key."""

  settings: samplers.Settings
  batch_size: int
  length: int
  block_size: int
  num_blocks: int
  window: int  # Positions a call of cache "none" reads.
  cache: str
  slots: int  # Positions the exact cache holds.
  guidance: float
  eos_id: Optional[int]
  offset: int = 0  # Where the first block starts: the positions before it are given.
  # "uniform": each block is sampled by `uniform_state.run` from uniform noise (settings'
  # method, steps, schedule and filters; its mask_id = V only marks unsampled buffer positions).
  process: str = "masked"

  @property
  def padded(self) -> int:
    return self.offset + self.num_blocks * self.block_size

  @property
  def rows(self) -> int:
    """Rows of every network call: under guidance, [rows; rows with the prompt masked]."""
    return 2 * self.batch_size if self.guidance else self.batch_size


def _initial(plan: Plan, prompt, prompt_mask):
  """(tokens [B, K b] with the given positions and masks elsewhere, given [B, K b] bool)."""
  shape, mask_id = (plan.batch_size, plan.padded), plan.settings.mask_id
  tokens = jnp.full(shape, mask_id, jnp.int32)
  given = jnp.zeros(shape, bool)
  if prompt is None:
    return tokens, given
  prompt = jnp.asarray(prompt, jnp.int32)
  width = prompt.shape[-1]
  prompt = jnp.broadcast_to(prompt, (plan.batch_size, width))
  # A position holding the mask id is filled, whatever prompt_mask says.
  shown = prompt != mask_id
  if prompt_mask is not None:
    shown &= jnp.broadcast_to(jnp.asarray(prompt_mask, bool), (plan.batch_size, width))
  tokens = tokens.at[:, :width].set(jnp.where(shown, prompt, mask_id))
  return tokens, given.at[:, :width].set(shown)


def _guided(plan: Plan, call, given):
  """call(z, alpha) -> logits under classifier-free guidance: one call on the doubled rows, the
  second half with the `given` positions masked."""
  if not plan.guidance:
    return call
  mask_id = plan.settings.mask_id
  return lambda z, alpha: samplers.mix_guidance(
    call(*samplers.with_prompt_masked(z, alpha, given, mask_id)), plan.guidance
  )


def _padded_inputs(plan: Plan, inputs):
  """A Denoiser's inputs [R, length] continued to the padded sample [R, K b]: the last column's
  segment, and positions counting on from its position."""
  extra = plan.padded - plan.length
  if inputs is None or not extra:
    return inputs
  padded = {}
  for name, value in inputs.items():
    value = jnp.asarray(value)
    last = value[:, -1:]
    more = last + 1 + jnp.arange(extra, dtype=value.dtype) if name == "positions" else last
    padded[name] = jnp.concatenate([value, jnp.broadcast_to(more, (value.shape[0], extra))], 1)
  return padded


def _window_inputs(plan: Plan, denoiser: Denoiser, first):
  """The denoiser reading the window [first, first + window) of its inputs (padded already)."""
  if denoiser.inputs is None or plan.window == plan.padded:
    return denoiser
  inputs = {
    name: jax.lax.dynamic_slice_in_dim(value, first, plan.window, axis=1)
    for name, value in denoiser.inputs.items()
  }
  return dataclasses.replace(denoiser, inputs=inputs)


def _window_denoiser(plan: Plan, denoiser, tokens, given, start):
  """Cache "none": block [start, start + b)'s denoise_fn, a call on the window ending with it."""
  if plan.window == plan.padded == plan.block_size:  # One block, the whole sample.
    return _guided(plan, denoiser, given)
  b, window, mask_id = plan.block_size, plan.window, plan.settings.mask_id
  first = jnp.maximum(start + b - window, 0)
  denoiser = _window_inputs(plan, denoiser, first)
  shown = jax.lax.dynamic_slice_in_dim(tokens, first, window, axis=1)
  shown_given = jax.lax.dynamic_slice_in_dim(given, first, window, axis=1)
  # Later positions are masked; a prompt token there is known, and shown.
  shown = jnp.where((first + jnp.arange(window) < start + b) | shown_given, shown, mask_id)
  offset = start - first
  guided = _guided(plan, denoiser, shown_given)

  def block_denoiser(z, alpha):
    logits = guided(jax.lax.dynamic_update_slice_in_dim(shown, z, offset, axis=1), alpha)
    return jax.lax.dynamic_slice_in_dim(logits, offset, b, axis=1)

  return block_denoiser


def _cached_call(plan: Plan, denoiser: Denoiser, tokens, start, cache, block_given):
  """call(z, alpha) -> (logits, keys and values) of block [start, start + b) against `cache`,
  on the doubled rows under guidance; a shifted network reads the token before each position."""
  b, shift_id = plan.block_size, denoiser.shift_id
  positions = jnp.broadcast_to(start + jnp.arange(b), (plan.rows, b))
  if shift_id is not None:  # The token before the block: the previous block's last, or BOS.
    before = jax.lax.dynamic_index_in_dim(tokens, jnp.maximum(start - 1, 0), axis=1)
    previous = jnp.where(start > 0, before, shift_id)

  def call(z, alpha):
    if shift_id is not None:
      z = jnp.concatenate([previous, z[:, :-1]], axis=1)
    if plan.guidance:
      z, alpha = samplers.with_prompt_masked(z, alpha, block_given, plan.settings.mask_id)
    return denoiser.block_call(z, alpha, positions, cache)

  return call


def _mixed(plan: Plan, logits):
  return samplers.mix_guidance(logits, plan.guidance) if plan.guidance else logits


def _block(plan: Plan, keys, denoiser, tokens, given, cache, block):
  """Samples block `block` of tokens with the rows' keys [B]: (tokens, cache, calls, cache
  writes, first broken call of the block or −1, trajectory)."""
  b, mask_id = plan.block_size, plan.settings.mask_id
  start = plan.offset + block * b
  z = jax.lax.dynamic_slice_in_dim(tokens, start, b, axis=1)
  block_given = jax.lax.dynamic_slice_in_dim(given, start, b, axis=1)
  clean_alpha = jnp.ones((plan.batch_size,), jnp.float32)  # A cache write reads clean tokens.
  extra_calls, writes, written = 0, 0, None
  if plan.cache == "none":
    block_denoiser = _window_denoiser(plan, denoiser, tokens, given, start)
  elif plan.cache == "exact":
    call = _cached_call(plan, denoiser, tokens, start, cache, block_given)
    if denoiser.shift_id is not None and b == 1:  # The block's input is clean: call once.
      logits, written = call(z, clean_alpha)
      block_denoiser = lambda z, alpha: _mixed(plan, logits)
    else:
      block_denoiser = lambda z, alpha: _mixed(plan, call(z, alpha)[0])
  else:  # prefix, dual: refresh every position's keys and values, then read them.
    layout = denoiser.cache_layout
    everywhere = jnp.broadcast_to(jnp.arange(plan.padded), (plan.rows, plan.padded))
    full, alpha = tokens, clean_alpha
    if plan.guidance:
      full, alpha = samplers.with_prompt_masked(full, alpha, given, mask_id)
    _, kv = denoiser.block_call(full, alpha, everywhere, layout.empty(plan.rows, 0))
    valid = readable_columns(plan.cache, plan.padded, start, b)
    call = _cached_call(plan, denoiser, tokens, start, {**kv, "valid": valid}, block_given)
    block_denoiser = lambda z, alpha: _mixed(plan, call(z, alpha)[0])
    extra_calls = 1
  block_keys = keys if plan.num_blocks == 1 else steps.fold_in(keys, block)
  new, calls, broken, trajectory = samplers.run(plan.settings, block_keys, block_denoiser, z)
  broken = jnp.where(broken >= 0, broken + extra_calls, -1)
  tokens = jax.lax.dynamic_update_slice_in_dim(tokens, new, start, axis=1)
  cache, writes = _written(plan, denoiser, tokens, start, cache, block_given, block, written)
  if plan.cache == "exact" and denoiser.shift_id is not None and b == 1:
    calls = jnp.int32(1)  # The block's own calls read the one call's logits.
  return tokens, cache, calls + extra_calls, writes, broken, trajectory


def _written(plan: Plan, denoiser, tokens, start, cache, block_given, block, written=None):
  """(cache with block `block`'s keys and values, the calls that cost: 0 or 1): the exact cache's
  ring of whole blocks gets the finished block's, computed from its clean tokens at α = 1."""
  if plan.cache != "exact" or not plan.slots:
    return cache, 0
  b, writes = plan.block_size, 0
  if written is None:
    clean_alpha = jnp.ones((plan.batch_size,), jnp.float32)
    new = jax.lax.dynamic_slice_in_dim(tokens, start, b, axis=1)
    _, written = _cached_call(plan, denoiser, tokens, start, cache, block_given)(new, clean_alpha)
    writes = 1
  slot = (block % max(plan.slots // b, 1)) * b  # A ring of whole blocks.
  cache = {
    "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], written["k"], slot, axis=2),
    "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], written["v"], slot, axis=2),
    "valid": jax.lax.dynamic_update_slice_in_dim(cache["valid"], jnp.ones(b, bool), slot, 0),
  }
  return cache, writes


_LATER_NOISE = 1 << 30  # fold_in data of the later positions' noise key (block indices are below).


def _uniform_block(plan: Plan, keys, denoiser, tokens, given, cache, block):
  """`_block` of the uniform-state process: block `block` sampled from uniform noise by
  `uniform_state.run`, each call reading every position's probability of holding its clean
  token (1 before the block and at given positions, the step's α in the block, 0 after: later
  positions are uniform draws), through a window (cache "none") or the exact cache."""
  b = plan.block_size
  start = plan.offset + block * b
  block_given = jax.lax.dynamic_slice_in_dim(given, start, b, axis=1)
  block_keys = keys if plan.num_blocks == 1 else steps.fold_in(keys, block)
  # The block's own draws are `uniform_state.run`'s from block_keys (one block: the rows' keys,
  # as a one-block sample without the decoder); the later positions' noise from a key beside them.
  noise_key = steps.fold_in(block_keys, _LATER_NOISE)
  if plan.cache == "exact":
    call = _cached_call(plan, denoiser, tokens, start, cache, block_given)
    block_denoiser = lambda z, alpha: call(z, jnp.where(block_given, 1.0, alpha[:, None]))[0]
  else:
    first = jnp.maximum(start + b - plan.window, 0)
    windowed = _window_inputs(plan, denoiser, first)
    columns = first + jnp.arange(plan.window)
    shown_given = jax.lax.dynamic_slice_in_dim(given, first, plan.window, axis=1)
    later = (columns >= start + b) & ~shown_given
    noise = uniform.uniform_tokens(noise_key, (plan.batch_size, plan.window), plan.settings.mask_id)
    shown = jnp.where(later, noise, jax.lax.dynamic_slice_in_dim(tokens, first, plan.window, 1))
    inside = (columns >= start) & (columns < start + b) & ~shown_given
    state = jnp.where(later, -1, inside.astype(jnp.int32))

    def block_denoiser(z, alpha):
      window = jax.lax.dynamic_update_slice_in_dim(shown, z, start - first, axis=1)
      logits = windowed(window, uniform.keep_probabilities(alpha, state))
      return jax.lax.dynamic_slice_in_dim(logits, start - first, b, axis=1)

  settings = plan.settings
  z = jax.lax.dynamic_slice_in_dim(tokens, start, b, axis=1)
  new, info = uniform_state.run(
    block_keys,
    block_denoiser,
    jnp.where(block_given, z, 0),
    ~block_given,
    schedule=settings.schedule,
    method=settings.method,
    num_steps=settings.num_steps,
    temperature=settings.temperature,
    top_k=settings.top_k,
    top_p=settings.top_p,
    noise=settings.noise,
  )
  tokens = jax.lax.dynamic_update_slice_in_dim(tokens, new, start, axis=1)
  cache, writes = _written(plan, denoiser, tokens, start, cache, block_given, block)
  return tokens, cache, info["nfe"], writes, info["nonfinite_call"], None


def _ended(plan: Plan, tokens, given, end):
  """[B] bool: the row holds an EOS it generated before position `end`."""
  columns = jnp.arange(tokens.shape[1])
  return ((tokens == plan.eos_id) & ~given & (columns < end)).any(-1)


def readable_columns(cache: str, length: int, start, block: int) -> jax.Array:
  """[length] bool: the cached columns a block's call at `start` reads, those before the block
  ("prefix") or every one outside it ("dual")."""
  columns = jnp.arange(length)
  if cache == "prefix":
    return columns < start
  return (columns < start) | (columns >= start + block)


def decode(plan: Plan, key, row_offset, denoiser, prompt, prompt_mask):
  rows = row_offset + jnp.arange(plan.batch_size, dtype=jnp.int32)
  keys = masking.row_keys(key, plan.batch_size, rows)  # Row r's key: fold_in(key, r).
  if denoiser.inputs is not None:
    denoiser = dataclasses.replace(denoiser, inputs=_padded_inputs(plan, denoiser.inputs))
  tokens, given = _initial(plan, prompt, prompt_mask)
  cache = None
  if plan.cache == "exact":
    cache = denoiser.cache_layout.empty(plan.rows, plan.slots)
  zero = jnp.int32(0)
  sample_block = _uniform_block if plan.process == "uniform" else _block
  if plan.num_blocks == 1:
    tokens, _, nfe, writes, broken, trajectory = sample_block(
      plan, keys, denoiser, tokens, given, cache, zero
    )
    blocks = jnp.int32(1)
  else:

    def more(carry):
      block, tokens = carry[0], carry[1]
      going = block < plan.num_blocks
      if plan.eos_id is not None:
        going &= ~_ended(plan, tokens, given, plan.offset + block * plan.block_size).all()
      return going

    def one_block(carry):
      block, tokens, cache, nfe, writes, broken = carry
      tokens, cache, calls, wrote, new_broken, _ = sample_block(
        plan, keys, denoiser, tokens, given, cache, block
      )
      broken = jnp.where((broken < 0) & (new_broken >= 0), nfe + new_broken, broken)
      return block + 1, tokens, cache, nfe + calls, writes + wrote, broken

    carry = (zero, tokens, cache, zero, zero, jnp.int32(-1))
    blocks, tokens, _, nfe, writes, broken = jax.lax.while_loop(more, one_block, carry)
    trajectory = None
  tokens = tokens[:, : plan.length]
  info = {"nfe": nfe, "nonfinite_call": broken, "num_blocks": blocks, "cache_writes": writes}
  if plan.offset:  # No block samples a position before the offset: one not given stays masked.
    info["unfilled"] = jnp.sum(~given[:, : plan.offset], dtype=jnp.int32)
  if plan.eos_id is not None:  # Generated tokens after a row's first generated EOS are EOS.
    given = given[:, : plan.length]
    is_eos = (tokens == plan.eos_id) & ~given
    lengths = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, plan.length)
    after = jnp.arange(plan.length) >= lengths[:, None]
    tokens = jnp.where(after & ~given, plan.eos_id, tokens)
    info["lengths"] = lengths.astype(jnp.int32)
  if trajectory is not None:
    info["trajectory"] = trajectory
  return tokens, info
