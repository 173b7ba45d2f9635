"""TPU splash attention (the Pallas kernel) for `md4jax.model.transformer`: its tile size and its call under a mesh."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def splash_block_size(length: int) -> int:
  """The splash kernel's tile along the sequence: the largest of 512, 256, 128 dividing it."""
  for block in (512, 256, 128):
    if length % block == 0:
      return block
  raise ValueError(f"splash attention needs a sequence length divisible by 128, got {length}.")


def splash_attention(q, k, v, segment_ids, causal: bool, interpret: bool = False, pattern=None):
  """TPU Pallas splash attention: q, k, v [B, L, H, Dh], segment_ids [B, L] or None, pattern
  a static [L, L] numpy bool mask (True = may attend; block diffusion's) or None.

  Packed documents attend within their segment. Under a mesh the kernel runs
  per device (shard_map over the batch and head axes); interpret=True runs the
  kernel's reference interpreter (any platform, slow: for tests).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks  # pylint: disable=g-import-not-at-top

  length, head_dim = q.shape[1], q.shape[-1]
  block = splash_block_size(length)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  if pattern is not None:
    base = masks.NumpyMask(pattern)
  elif causal:
    base = masks.CausalMask((length, length))
  else:
    base = masks.FullMask((length, length))
  q = q * jnp.asarray(head_dim**-0.5, q.dtype)  # The kernel does not scale the logits.
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # [B, H, L, Dh]
  if segment_ids is None:
    segment_ids = jnp.ones(q.shape[:1] + q.shape[2:3], jnp.int32)

  def per_device(q, k, v, segments):
    kernel = splash.make_splash_mha(
      masks.MultiHeadMask([base] * q.shape[1]),
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
    )
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(
      q, k, v, segments
    )

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    out = per_device(q, k, v, segment_ids)
  else:
    heads = nn.logical_to_mesh_axes(("batch", "heads", "length", "head_dim"))
    rows = nn.logical_to_mesh_axes(("batch", "length"))
    out = jax.shard_map(
      per_device, mesh=mesh, in_specs=(heads, heads, heads, rows), out_specs=heads, check_vma=False
    )(q, k, v, segment_ids)
  return jnp.swapaxes(out, 1, 2)
