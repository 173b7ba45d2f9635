"""Denoiser network: a pre-norm Transformer mapping (tokens, alpha) to logits.

This module holds no diffusion math. The same network serves as the
bidirectional masked-diffusion denoiser (`causal=False`, optionally conditioned
on alpha(t) via adaLN-Zero) and as the autoregressive baseline (`causal=True`).
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

_TIME_CONDITIONINGS = ("none", "adaln")
_INIT_STD = 0.02


def apply_rope(x, positions, base=10000.0):
  """Rotary position embedding (half-split / GPT-NeoX layout).

  Args:
    x: [..., L, H, Dh] queries or keys, Dh even.
    positions: integer positions broadcastable to x's leading dims, e.g. [L].
    base: rotation base; frequency i is base**(-2i/Dh).

  Returns:
    x rotated, same shape and dtype as x. Angles and the rotation are computed
    in float32 because bf16 angles lose the position resolution at long L.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
  half = head_dim // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., L, half]
  angles = angles[..., None, :]  # broadcast over heads
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def timestep_features(alpha, dim, max_period=10000.0):
  """Sinusoidal features of alpha in [0, 1] -> [B, dim] float32.

  alpha is scaled by 1000 first so that the [0, 1] range spans many periods of
  the fastest frequencies (as diffusion models do with integer timesteps).
  """
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = 1000.0 * jnp.asarray(alpha, jnp.float32)[:, None] * freqs
  feats = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
  if dim % 2:
    feats = jnp.pad(feats, ((0, 0), (0, 1)))
  return feats


def segment_attention_mask(segment_ids):
  """[B, L] segment ids -> [B, 1, L, L] bool: True where query and key share a nonzero segment.

  Padding (segment 0) attends to itself only, so its softmax row is never
  empty (no NaN) and no real token attends to padding.
  """
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  real = (segment_ids != 0)[:, :, None]
  own = jnp.eye(segment_ids.shape[-1], dtype=bool)[None]
  return ((same & real) | own)[:, None]


def _modulate(x, shift, scale):
  # shift/scale are [B, D]; broadcast over the sequence axis.
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Attention(nn.Module):
  """Multi-head self-attention with RoPE; no biases."""
  num_heads: int
  causal: bool
  out_std: float
  rope_base: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, mask=None, positions=None):
    """x [B, L, D]; mask [B, 1, L, L] bool (True = may attend) or None; positions [B, L] or None."""
    model_dim = x.shape[-1]
    head_dim = model_dim // self.num_heads
    # One fused matmul for q, k, v: kernel [D, 3, H, Dh].
    qkv = nn.DenseGeneral(
        features=(3, self.num_heads, head_dim), use_bias=False, dtype=self.dtype,
        param_dtype=jnp.float32, kernel_init=nn.initializers.normal(_INIT_STD),
        name="qkv")(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, L, H, Dh]
    if positions is None:
      positions = jnp.arange(x.shape[1])
    q = apply_rope(q, positions, self.rope_base)
    k = apply_rope(k, positions, self.rope_base)
    # With both, attention is allowed where the mask is True and causality holds.
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.causal)
    return nn.DenseGeneral(
        features=model_dim, axis=(-2, -1), use_bias=False, dtype=self.dtype,
        param_dtype=jnp.float32, kernel_init=nn.initializers.normal(self.out_std),
        name="out")(out)


class SwiGLU(nn.Module):
  """Gated MLP: W_down(silu(x W_gate) * (x W_up)); no biases."""
  mlp_dim: int
  out_std: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    dense = lambda feats, std, name: nn.Dense(
        feats, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std), name=name)
    gate = dense(self.mlp_dim, _INIT_STD, "gate")(x)
    up = dense(self.mlp_dim, _INIT_STD, "up")(x)
    return dense(x.shape[-1], self.out_std, "down")(nn.silu(gate) * up)


class Block(nn.Module):
  """Pre-norm Transformer block, optionally adaLN-Zero modulated by `cond`."""
  num_heads: int
  mlp_dim: int
  causal: bool
  out_std: float
  rope_base: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, cond=None, mask=None, positions=None):
    model_dim = x.shape[-1]
    norm = lambda name: nn.RMSNorm(dtype=self.dtype, param_dtype=jnp.float32, name=name)
    attn = Attention(self.num_heads, self.causal, self.out_std, self.rope_base,
                     self.dtype, name="attn")
    mlp = SwiGLU(self.mlp_dim, self.out_std, self.dtype, name="mlp")
    if cond is None:
      x = x + attn(norm("attn_norm")(x), mask, positions)
      return x + mlp(norm("mlp_norm")(x))
    # Zero init: gates are 0, so the block starts as the identity and the
    # conditioning is learned in smoothly (adaLN-Zero, Peebles & Xie 2023).
    mod = nn.Dense(6 * model_dim, use_bias=False, dtype=self.dtype,
                   param_dtype=jnp.float32, kernel_init=nn.initializers.zeros,
                   name="adaln")(cond)
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
    x = x + gate1[:, None, :] * attn(_modulate(norm("attn_norm")(x), shift1, scale1), mask,
                                     positions)
    return x + gate2[:, None, :] * mlp(_modulate(norm("mlp_norm")(x), shift2, scale2))


class Transformer(nn.Module):
  """Denoiser: tokens [B, L] in [0, V] (V = mask id) -> logits [B, L, V] float32.

  Embedding init is normal(0.02) (GPT-2 style): with pre-norm blocks the
  residual-stream scale does not affect the normalized inputs, and small
  embeddings keep the residual contributions of the blocks comparable.
  """
  vocab_size: int
  num_layers: int
  model_dim: int
  num_heads: int
  mlp_dim: int
  causal: bool = False
  time_conditioning: str = "none"
  dtype: jnp.dtype = jnp.float32
  rope_base: float = 10000.0

  def _check_config(self, alpha):
    if self.time_conditioning not in _TIME_CONDITIONINGS:
      raise ValueError(f"unknown time_conditioning {self.time_conditioning!r}; "
                       f"expected one of {_TIME_CONDITIONINGS}")
    if self.model_dim % self.num_heads:
      raise ValueError(f"model_dim {self.model_dim} is not divisible by "
                       f"num_heads {self.num_heads}")
    head_dim = self.model_dim // self.num_heads
    if head_dim % 2:
      raise ValueError(f"head dim {head_dim} (model_dim / num_heads) must be even for RoPE")
    if self.time_conditioning == "adaln" and alpha is None:
      raise ValueError("time_conditioning='adaln' requires alpha, got None")

  @nn.compact
  def __call__(self, tokens, alpha=None, segment_ids=None, positions=None):
    """tokens [B, L] int32; alpha [B] float (alpha(t) per sequence) or None.

    segment_ids [B, L] int (1, 2, ... per packed document, 0 = padding) or None:
    given, a position attends only to positions of its own nonzero segment.
    positions [B, L] int (restarting per document) or None (0 .. L-1) feed RoPE.
    """
    self._check_config(alpha)
    mask = None
    if segment_ids is not None:
      segment_ids = jnp.asarray(segment_ids)
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must have the tokens' shape {tokens.shape}, "
                         f"got {segment_ids.shape}")
      mask = segment_attention_mask(segment_ids)
    if positions is not None and jnp.shape(positions) != tokens.shape:
      raise ValueError(f"positions must have the tokens' shape {tokens.shape}, "
                       f"got {jnp.shape(positions)}")
    dense_init = nn.initializers.normal(_INIT_STD)
    # Matrices writing into the residual stream are scaled down with depth so
    # the stream's variance at init does not grow with num_layers (GPT-2).
    out_std = _INIT_STD / math.sqrt(2 * self.num_layers)

    # V + 1 rows: the extra row is the mask token (input only).
    x = nn.Embed(self.vocab_size + 1, self.model_dim, dtype=self.dtype,
                 param_dtype=jnp.float32, embedding_init=dense_init,
                 name="embed")(tokens)

    cond = None
    if self.time_conditioning == "adaln":
      alpha = jnp.asarray(alpha)
      if alpha.shape != (tokens.shape[0],):
        raise ValueError(f"alpha must have shape [B]=({tokens.shape[0]},), got {alpha.shape}")
      dense = lambda name: nn.Dense(self.model_dim, use_bias=False, dtype=self.dtype,
                                    param_dtype=jnp.float32, kernel_init=dense_init,
                                    name=name)
      c = dense("time_in")(timestep_features(alpha, self.model_dim))
      c = dense("time_out")(nn.silu(c))
      # Every modulation Dense consumes silu(c), as in DiT; compute it once.
      cond = nn.silu(c)

    for i in range(self.num_layers):
      x = Block(self.num_heads, self.mlp_dim, self.causal, out_std, self.rope_base,
                self.dtype, name=f"block_{i}")(x, cond, mask, positions)

    x = nn.RMSNorm(dtype=self.dtype, param_dtype=jnp.float32, name="final_norm")(x)
    if cond is not None:
      mod = nn.Dense(2 * self.model_dim, use_bias=False, dtype=self.dtype,
                     param_dtype=jnp.float32, kernel_init=nn.initializers.zeros,
                     name="final_adaln")(cond)
      shift, scale = jnp.split(mod, 2, axis=-1)
      x = _modulate(x, shift, scale)
    logits = nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype,
                      param_dtype=jnp.float32, kernel_init=dense_init,
                      name="logits")(x)
    return logits.astype(jnp.float32)


def count_params(params) -> int:
  """Total number of scalars in a parameter pytree."""
  return int(sum(x.size for x in jax.tree.leaves(params)))


def flops_per_token(num_layers, model_dim, mlp_dim, seq_len, vocab_size) -> float:
  """Forward-pass FLOPs per token (training ~= 3x this).

  With D = model_dim, F = mlp_dim, L = seq_len, N = num_layers, V = vocab_size:

    matmul params  P = N * (4 D^2 + 3 D F) + D V    (qkv + out; gate, up, down; logits)
    attention      A = N * 2 * 2 * L * D            (QK^T and AV: each 2*L*D per token)
    FLOPs/token    = 2 P + A

  Embedding lookups, norms, softmax, RoPE and the per-sequence adaLN MLPs are
  ignored; causal masking is not discounted (the full L x L is computed).
  """
  matmul_params = num_layers * (4 * model_dim**2 + 3 * model_dim * mlp_dim)
  matmul_params += model_dim * vocab_size
  attention = num_layers * 2 * 2 * seq_len * model_dim
  return float(2 * matmul_params + attention)
