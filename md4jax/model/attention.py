"""Self-attention: the Attention layer (RoPE, optional grouped-query heads and q/k/v biases;
XLA, cuDNN or the TPU splash kernel) and its masks.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.model import lora
from md4jax.model.layers import HEADS, Projection, constrain, kernel_init
from md4jax.model.rope import rotate
from md4jax.model.splash import splash_attention

ATTENTIONS = ("xla", "cudnn", "splash")


def block_pattern(length: int, block_size: int, two_stream: bool, xp=np):
  """Block diffusion's attention pattern (True = may attend), static, as a numpy array (xp=np,
  the splash kernel's mask) or built in the graph from iota (xp=jnp: XLA's; a [2L, 2L] constant
  instead made the TPU compiler crash under remat at L = 1024).

  One stream ([L, L]): a position in block k attends to blocks <= k, so a block never reads
  what comes after it. Two streams ([2L, 2L], BD3-LM's training pass over z_t ⊕ x): a noisy
  position of block k attends to its own noisy block and to the clean blocks < k; a clean
  position of block k to the clean blocks <= k, never to a noisy one.
  """
  if not two_stream:
    block = xp.arange(length) // block_size
    return block[:, None] >= block[None, :]
  half = length // 2
  block = xp.arange(half) // block_size
  same, before = block[:, None] == block[None, :], block[:, None] > block[None, :]
  return xp.block([[same, before], [xp.zeros_like(same), same | before]])


def segment_attention_mask(segment_ids):
  """[B, L] segment ids -> [B, 1, L, L] bool: True where query and key share a nonzero segment.

  Padding (segment 0) attends to itself only, so its softmax row is never
  empty (no NaN) and no real token attends to padding.
  """
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  real = (segment_ids != 0)[:, :, None]
  own = jnp.eye(segment_ids.shape[-1], dtype=bool)[None]
  return ((same & real) | own)[:, None]


def softmax_attention(q, k, v, mask=None, causal: bool = False):
  """q, k, v [B, L, H, Dh]; mask [B, 1, L, L] bool (True = may attend) or None -> [B, L, H, Dh].

  Plain einsum-softmax attention: the same math as jax.nn.dot_product_attention, which on CPU
  lowers to a slower graph (docs/performance.md). Scores and softmax are float32.
  """
  scores = jnp.einsum(
    "bqhd,bkhd->bhqk",
    q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype),
    k,
    preferred_element_type=jnp.float32,
  )
  allowed = mask
  if causal:
    lower = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    allowed = lower if allowed is None else allowed & lower
  if allowed is not None:
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(nn.Module):
  """Multi-head self-attention with RoPE; no output bias.

  With num_kv_heads < num_heads (grouped-query attention, Llama's and Qwen2's), the keys and
  values have num_kv_heads heads, each read by num_heads / num_kv_heads consecutive query heads;
  they are repeated to num_heads just before the attention kernel, so every implementation sees
  the usual shapes while a KV cache holds num_kv_heads heads ([.., Hkv, Dh]).
  """

  num_heads: int
  causal: bool
  weight_init: str  # WEIGHT_INITS
  num_layers: int  # Of the whole network: the depth-scaled inits use it.
  dtype: jnp.dtype
  implementation: str = "xla"
  # (block_size, two_stream) of `block_pattern`, which restricts every mask; () = none.
  block_layout: tuple = ()
  num_kv_heads: int = 0  # Key and value heads (grouped-query attention); 0 = num_heads.
  qkv_bias: bool = False  # A bias on the query, key and value projections (Qwen2's).
  lora_rank: int = 0  # LoRA adapters of this rank on every projection (`Projection`); 0 = none.
  lora_alpha: float = lora.DEFAULT_ALPHA  # The LoRA update's scale is lora_alpha / lora_rank (> 0).

  def _projection(self, shape, num_in, names, initializer, bias=False, *, name):
    return Projection(
      shape,
      num_in,
      names,
      initializer,
      self.dtype,
      bias,
      self.lora_rank,
      self.lora_alpha,
      name=name,
    )

  @nn.compact
  def __call__(self, x, rope, mask=None, segment_ids=None, cache=None):
    """x [B, L, D]; rope (cos, sin) [B or 1, L, Dh / 2] (`rope_cos_sin`); mask [B, 1, L, L]
    bool (True = may attend) or None; segment_ids [B, L] or None (the splash kernel's form of
    the mask).

    cache (keys, values [B, C, Hkv, Dh], valid [C] bool): x is one block that reads the valid
    cached positions and itself, causally in a causal network (the block decoder's KV caches);
    returns (out, (k, v) of x, [B, L, Hkv, Dh]).
    """
    pattern = None
    if self.block_layout and self.implementation == "splash":
      pattern = block_pattern(x.shape[1], *self.block_layout)
    elif self.block_layout:
      allowed = block_pattern(x.shape[1], *self.block_layout, xp=jnp)[None, None]
      mask = allowed if mask is None else mask & allowed
    model_dim = x.shape[-1]
    head_dim = model_dim // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    cos, sin = rope
    if kv_heads == self.num_heads:
      # One fused matmul for q, k, v: kernel [D, 3, H, Dh].
      qkv = self._projection(
        (model_dim, 3, self.num_heads, head_dim),
        1,
        ("embed", "qkv", "heads", "head_dim"),
        kernel_init(self.weight_init, self.num_layers, 0, (1, 2, 3)),
        self.qkv_bias,
        name="qkv",
      )(x)
      # RoPE rotates q and k together ([B, L, 2, H, Dh], cos and sin broadcast over the pair):
      # one pass instead of two (faster; docs/performance.md). Split and unstacked, not indexed:
      # the gradient is one concatenation, not zero-padded copies summed.
      qk, v = jnp.split(qkv, [2], axis=2)
      qk = rotate(qk, cos[:, :, None], sin[:, :, None])
      q, k = jnp.unstack(qk, axis=2)  # each [B, L, H, Dh]
      v = v[:, :, 0]
    else:
      q, k, v = self._grouped_qkv(x, cos, sin, head_dim, kv_heads)
    group = self.num_heads // kv_heads
    q = constrain(q, HEADS)
    # With a mask and causal both, attention is allowed where the mask is True and causality holds.
    if cache is not None:
      cached_k, cached_v, valid = cache
      own = jnp.ones((x.shape[1], x.shape[1]), bool)
      own = jnp.tril(own) if self.causal else own
      allowed = jnp.concatenate([jnp.broadcast_to(valid, (x.shape[1], valid.shape[0])), own], -1)
      out = softmax_attention(
        q,
        _repeat_heads(jnp.concatenate([cached_k.astype(k.dtype), k], axis=1), group),
        _repeat_heads(jnp.concatenate([cached_v.astype(v.dtype), v], axis=1), group),
        allowed[None, None],
      )
    else:
      repeated = [constrain(_repeat_heads(a, group), HEADS) for a in (k, v)]
      if self.implementation == "splash":
        out = splash_attention(q, *repeated, segment_ids, self.causal, pattern=pattern)
      elif self.implementation == "cudnn":
        out = jax.nn.dot_product_attention(
          q, *repeated, mask=mask, is_causal=self.causal, implementation="cudnn"
        )
      else:
        out = softmax_attention(q, *repeated, mask, self.causal)
    out = constrain(out, HEADS)
    out_init = kernel_init(self.weight_init, self.num_layers, (0, 1), 2, writes_residual=True)
    out = self._projection(
      (self.num_heads, head_dim, model_dim), 2, ("heads", "head_dim", "embed"), out_init, name="out"
    )(out)
    return out if cache is None else (out, (k, v))

  def _grouped_qkv(self, x, cos, sin, head_dim: int, kv_heads: int):
    """q [B, L, H, Dh] and k, v [B, L, Hkv, Dh] from a q kernel [D, H, Dh] and a kv kernel
    [D, 2, Hkv, Dh] (query head j reads key and value head j // (H / kv_heads))."""
    model_dim = x.shape[-1]
    q = self._projection(
      (model_dim, self.num_heads, head_dim),
      1,
      ("embed", "heads", "head_dim"),
      kernel_init(self.weight_init, self.num_layers, 0, (1, 2)),
      self.qkv_bias,
      name="q",
    )(x)
    kv = self._projection(
      (model_dim, 2, kv_heads, head_dim),
      1,
      ("embed", "qkv", "heads", "head_dim"),
      kernel_init(self.weight_init, self.num_layers, 0, (1, 2, 3)),
      self.qkv_bias,
      name="kv",
    )(x)
    k, v = jnp.unstack(kv, axis=2)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _repeat_heads(kv, group: int):
  """Keys or values [B, L, Hkv, Dh] for every query head: each head repeated `group` times."""
  return kv if group == 1 else jnp.repeat(kv, group, axis=2)
