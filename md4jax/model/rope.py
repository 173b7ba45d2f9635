"""Rotary position embedding (half-split / GPT-NeoX layout) for `md4jax.model.transformer`."""

import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, base: float = 10000.0) -> np.ndarray:
  """RoPE's float32 frequencies [Dh / 2]: frequency i is base**(-2i/Dh)."""
  half = head_dim // 2
  return np.float32(base) ** (-np.arange(half, dtype=np.float32) / np.float32(half))


def rope_cos_sin(positions, head_dim: int, base: float = 10000.0, num_positions=None):
  """cos and sin of RoPE's angles position · frequency, float32 [..., Dh / 2], at positions.

  With num_positions, they are looked up in a table of positions 0 .. num_positions − 1
  computed on the host (out-of-range positions give NaN, never a silent wrong angle): cos and
  sin evaluated in the network are fused by XLA:CPU into every layer's rotation and recomputed
  for each query, key and head. The table holds the float64 cos and sin of the same float32
  angles, rounded to float32 (within an ulp of the exact values).
  """
  frequencies = rope_frequencies(head_dim, base)
  if num_positions is None:
    angles = jnp.asarray(positions, jnp.float32)[..., None] * frequencies
    return jnp.cos(angles), jnp.sin(angles)
  angles = (np.arange(num_positions, dtype=np.float32)[:, None] * frequencies).astype(np.float64)
  positions = jnp.asarray(positions)
  rows = jnp.where(positions < 0, num_positions, positions)  # take() would wrap a negative one.
  tables = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
  return tuple(jnp.take(table, rows, axis=0, mode="fill", fill_value=np.nan) for table in tables)


def rotate(x, cos, sin):
  """RoPE's rotation (half-split / GPT-NeoX layout) of x [..., L, H, Dh] by cos and sin
  [..., L, Dh / 2] (`rope_cos_sin`).

  Computed in float32 (bf16 angles lose the position resolution at long L); the output has
  x's shape and dtype.
  """
  cos, sin = cos[..., None, :], sin[..., None, :]  # Broadcast over heads.
  # A split, not two slices: its gradient is one concatenation, not two zero-padded copies summed.
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope(x, positions, base=10000.0):
  """Rotary position embedding of x [..., L, H, Dh] (Dh even) at integer positions
  broadcastable to x's leading dims, e.g. [L], at any position (cos and sin evaluated by
  XLA: the model's table to within float32 rounding)."""
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
  return rotate(x, *rope_cos_sin(positions, head_dim, base))
