"""Denoiser network: a pre-norm Transformer mapping (tokens, alpha) to logits.

This module holds no diffusion math. The same network serves as the
bidirectional masked-diffusion denoiser (`causal=False`, optionally conditioned
on alpha(t) via adaLN-Zero) and as the autoregressive baseline (`causal=True`).

Every param and the main activations carry logical axis names ("embed",
"heads", "mlp", ...); `md4jax.runtime.sharding` maps them to mesh axes. Without a
mesh in context the names change nothing.
"""
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.model.projection import PROJECTION, named_projection
from md4jax.model.rope import rope_cos_sin, rotate
from md4jax.model.splash import splash_attention, splash_block_size  # Re-exported: callers know them here.

ATTENTIONS = ("xla", "cudnn", "splash")
REMATS = ("none", "full", "save_dots")
NORMS = ("rms", "layer")  # RMSNorm with a learned scale; LayerNorm without scale or bias (MD4's).
MLPS = ("swiglu", "sigmoid_glu")  # Gate silu(x W_g) or sigmoid(x W_g), times x W_up.
OUTPUT_INITS = ("normal", "zeros")
_TIME_CONDITIONINGS = ("none", "adaln")
_INIT_STD = 0.02

# Logical names of activations.
_HIDDEN = ("batch", "length", "embed")
_HEADS = ("batch", "length", "heads", "head_dim")


def _init(initializer, names):
  """An initializer whose param carries logical axis names (for sharding)."""
  return nn.with_logical_partitioning(initializer, names)


def _kernel(module: nn.Module, shape: tuple, names: tuple, std: float):
  """The module's float32 param "kernel", normal(std) at init, with logical axis names."""
  return module.param("kernel", _init(nn.initializers.normal(std), names), shape, jnp.float32)


def _constrain(x, names):
  return nn.with_logical_constraint(x, names)


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


def softmax_attention(q, k, v, mask=None, causal: bool = False):
  """q, k, v [B, L, H, Dh]; mask [B, 1, L, L] bool (True = may attend) or None -> [B, L, H, Dh].

  Plain einsum-softmax attention: the same math as jax.nn.dot_product_attention,
  which on CPU lowers to a slower graph (issue 14). Scores and softmax are float32.
  """
  scores = jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k,
                      preferred_element_type=jnp.float32)
  allowed = mask
  if causal:
    lower = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    allowed = lower if allowed is None else allowed & lower
  if allowed is not None:
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _modulate(x, shift, scale):
  # shift/scale are [B, D]; broadcast over the sequence axis.
  return x * (1 + scale[:, None, :]) + shift[:, None, :]


class _Projection(nn.Module):
  """x [..., *in] -> [..., *out] by a float32 param "kernel" [*in, *out] (as nn.Dense's; no
  bias) with logical axis names, contracting x's last num_in dims (`projection.project`).

  (nn.DenseGeneral initializes a flat kernel and reshapes it, which breaks the
  named-axis constraint flax applies when it checks an existing param's shape.)
  """
  shape: tuple
  num_in: int
  names: tuple
  std: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    x, kernel = nn.dtypes.promote_dtype(x, _kernel(self, self.shape, self.names, self.std),
                                        dtype=self.dtype)
    return named_projection(x, kernel, self.num_in)


class Attention(nn.Module):
  """Multi-head self-attention with RoPE; no biases."""
  num_heads: int
  causal: bool
  out_std: float
  dtype: jnp.dtype
  implementation: str = "xla"

  @nn.compact
  def __call__(self, x, rope, mask=None, segment_ids=None):
    """x [B, L, D]; rope (cos, sin) [B or 1, L, Dh / 2] (`rope_cos_sin`); mask [B, 1, L, L]
    bool (True = may attend) or None; segment_ids [B, L] or None (the splash kernel's form of
    the mask)."""
    model_dim = x.shape[-1]
    head_dim = model_dim // self.num_heads
    # One fused matmul for q, k, v: kernel [D, 3, H, Dh].
    qkv = _Projection((model_dim, 3, self.num_heads, head_dim), 1,
                      ("embed", "qkv", "heads", "head_dim"), _INIT_STD, self.dtype, name="qkv")(x)
    # RoPE rotates q and k together ([B, L, 2, H, Dh], cos and sin broadcast over the pair): one
    # pass instead of two (the 4x256 step: 6% faster). Split and unstacked, not indexed: the
    # gradient is one concatenation, not zero-padded copies summed.
    qk, v = jnp.split(qkv, [2], axis=2)
    cos, sin = rope
    qk = rotate(qk, cos[:, :, None], sin[:, :, None])
    q, k = (_constrain(a, _HEADS) for a in jnp.unstack(qk, axis=2))  # each [B, L, H, Dh]
    v = _constrain(v[:, :, 0], _HEADS)
    # With a mask and causal both, attention is allowed where the mask is True and causality holds.
    if self.implementation == "splash":
      out = splash_attention(q, k, v, segment_ids, self.causal)
    elif self.implementation == "cudnn":
      out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.causal,
                                         implementation="cudnn")
    else:
      out = softmax_attention(q, k, v, mask, self.causal)
    out = _constrain(out, _HEADS)
    return _Projection((self.num_heads, head_dim, model_dim), 2, ("heads", "head_dim", "embed"),
                       self.out_std, self.dtype, name="out")(out)


class SwiGLU(nn.Module):
  """Gated MLP: W_down(silu(x W_gate) * (x W_up)), or with a sigmoid gate; no biases."""
  mlp_dim: int
  out_std: float
  dtype: jnp.dtype
  gate: str = "swiglu"

  @nn.compact
  def __call__(self, x):
    model_dim = x.shape[-1]
    # W_gate and W_up as two matmuls (`project`): stacked into one [D, 2, F] kernel, every step
    # copied both kernels and concatenated the two gradients (4x256 step: 4% slower).
    gate, up = (_Projection((model_dim, self.mlp_dim), 1, ("embed", "mlp"), _INIT_STD, self.dtype,
                            name=name)(x) for name in ("gate", "up"))
    activation = nn.silu if self.gate == "swiglu" else nn.sigmoid
    hidden = _constrain(activation(gate) * up, ("batch", "length", "mlp"))
    return _Projection((self.mlp_dim, model_dim), 1, ("mlp", "embed"), self.out_std, self.dtype,
                       name="down")(hidden)


def _norm(kind, dtype, name):
  if kind == "layer":
    return nn.LayerNorm(use_scale=False, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name)
  return nn.RMSNorm(dtype=dtype, param_dtype=jnp.float32,
                    scale_init=_init(nn.initializers.ones, ("embed",)), name=name)


class Block(nn.Module):
  """Pre-norm Transformer block, optionally adaLN-Zero modulated by `cond`."""
  num_heads: int
  mlp_dim: int
  causal: bool
  out_std: float
  dtype: jnp.dtype
  attention: str = "xla"
  norm: str = "rms"
  mlp: str = "swiglu"

  @nn.compact
  def __call__(self, x, cond, mask, rope, segment_ids=None):
    """x [B, L, D]; cond [B, D] or None; mask, rope and segment_ids as Attention takes them."""
    model_dim = x.shape[-1]
    norm = lambda name: _norm(self.norm, self.dtype, name)
    attn = Attention(self.num_heads, self.causal, self.out_std, self.dtype, self.attention,
                     name="attn")
    mlp = SwiGLU(self.mlp_dim, self.out_std, self.dtype, self.mlp, name="mlp")
    if cond is None:
      x = x + attn(norm("attn_norm")(x), rope, mask, segment_ids)
      return _constrain(x + mlp(norm("mlp_norm")(x)), _HIDDEN)
    # Zero init: gates are 0, so the block starts as the identity and the
    # conditioning is learned in smoothly (adaLN-Zero, Peebles & Xie 2023).
    mod = nn.Dense(6 * model_dim, use_bias=False, dtype=self.dtype,
                   param_dtype=jnp.float32,
                   kernel_init=_init(nn.initializers.zeros, ("embed", "modulation")),
                   name="adaln")(cond)
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
    x = x + gate1[:, None, :] * attn(_modulate(norm("attn_norm")(x), shift1, scale1),
                                     rope, mask, segment_ids)
    x = x + gate2[:, None, :] * mlp(_modulate(norm("mlp_norm")(x), shift2, scale2))
    return _constrain(x, _HIDDEN)


class _ScannedBlock(nn.Module):
  """A Block in nn.scan's (carry, out) form: the residual stream is the carry."""
  block: type
  kwargs: dict

  @nn.compact
  def __call__(self, x, cond, mask, rope, segment_ids):
    return self.block(**self.kwargs, name="block")(x, cond, mask, rope, segment_ids), None


def _remat_policy(remat: str):
  """jax.checkpoint policy: "full" saves nothing, "save_dots" keeps the weight matmuls' outputs
  (`project`'s by name: a policy does not see the matmul inside a custom_vjp)."""
  if remat == "full":
    return None
  policies = jax.checkpoint_policies
  return policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                          policies.save_only_these_names(PROJECTION))


class Transformer(nn.Module):
  """Denoiser: tokens [B, L] in [0, V] (V = mask id) -> logits [B, L, V] in the compute dtype.

  Embedding init is normal(0.02) (GPT-2 style): with pre-norm blocks the
  residual-stream scale does not affect the normalized inputs, and small
  embeddings keep the residual contributions of the blocks comparable.

  remat ("none", "full", "save_dots") recomputes each block's activations in
  the backward pass; scan_layers runs the blocks under nn.scan (params stacked
  on a leading "layers" axis), so compile time does not grow with depth.
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
  attention: str = "xla"
  remat: str = "none"
  scan_layers: bool = False
  norm: str = "rms"
  mlp: str = "swiglu"
  embed_dim: int = 0  # Token embedding width, projected to model_dim; 0 = model_dim, no projection.
  output_init: str = "normal"

  def _check_config(self, alpha):
    if self.time_conditioning not in _TIME_CONDITIONINGS:
      raise ValueError(f"unknown time_conditioning {self.time_conditioning!r}; "
                       f"expected one of {_TIME_CONDITIONINGS}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"unknown attention {self.attention!r}; expected one of {ATTENTIONS}")
    for name, value, valid in (("remat", self.remat, REMATS), ("norm", self.norm, NORMS),
                               ("mlp", self.mlp, MLPS), ("output_init", self.output_init, OUTPUT_INITS)):
      if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; expected one of {valid}")
    if self.model_dim % self.num_heads:
      raise ValueError(f"model_dim {self.model_dim} is not divisible by "
                       f"num_heads {self.num_heads}")
    head_dim = self.model_dim // self.num_heads
    if head_dim % 2:
      raise ValueError(f"head dim {head_dim} (model_dim / num_heads) must be even for RoPE")
    if self.time_conditioning == "adaln" and alpha is None:
      raise ValueError("time_conditioning='adaln' requires alpha, got None")

  def _blocks(self, x, cond, mask, rope, segment_ids):
    # Matrices writing into the residual stream are scaled down with depth so
    # the stream's variance at init does not grow with num_layers (GPT-2).
    kwargs = dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim, causal=self.causal,
                  out_std=_INIT_STD / math.sqrt(2 * self.num_layers), dtype=self.dtype,
                  attention=self.attention, norm=self.norm, mlp=self.mlp)
    block = Block
    if self.remat != "none":
      # Under scan, the loop already keeps XLA from merging recomputation into the forward pass.
      block = nn.remat(Block, policy=_remat_policy(self.remat), prevent_cse=not self.scan_layers)
    if not self.scan_layers:
      for i in range(self.num_layers):
        x = block(**kwargs, name=f"block_{i}")(x, cond, mask, rope, segment_ids)
      return x
    scanned = nn.scan(_ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast,) * 4, length=self.num_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = scanned(block, kwargs, name="blocks")(x, cond, mask, rope, segment_ids)
    return x

  @nn.compact
  def __call__(self, tokens, alpha=None, segment_ids=None, positions=None):
    """tokens [B, L] int32; alpha [B] float (alpha(t) per sequence; t for a state-dependent schedule) or None.

    segment_ids [B, L] int (1, 2, ... per packed document, 0 = padding) or None:
    given, a position attends only to positions of its own nonzero segment.
    positions [B, L] int in [0, L) (restarting per document) or None (0 .. L-1) feed RoPE.
    """
    self._check_config(alpha)
    chex.assert_rank(tokens, 2, custom_message="Transformer: tokens must be [B, L]")
    chex.assert_type(tokens, int, custom_message="Transformer: tokens must be integer ids")
    mask = None
    if segment_ids is not None:
      segment_ids = jnp.asarray(segment_ids)
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must have the tokens' shape {tokens.shape}, "
                         f"got {segment_ids.shape}")
      if self.attention != "splash":
        mask = segment_attention_mask(segment_ids)
    if positions is not None and jnp.shape(positions) != tokens.shape:
      raise ValueError(f"positions must have the tokens' shape {tokens.shape}, "
                       f"got {jnp.shape(positions)}")
    if positions is not None and not isinstance(positions, jax.core.Tracer):
      # Traced positions out of range give NaN logits (rope_cos_sin); known ones are refused here.
      known = np.asarray(positions)
      outside = known[(known < 0) | (known >= tokens.shape[1])]
      if outside.size:
        raise ValueError(f"positions must lie in [0, {tokens.shape[1]}) (the sequence length), "
                         f"got {outside.ravel()[:5].tolist()}")
    dense_init = nn.initializers.normal(_INIT_STD)

    # V + 1 rows: the extra row is the mask token (input only).
    embed_dim = self.embed_dim or self.model_dim
    x = nn.Embed(self.vocab_size + 1, embed_dim, dtype=self.dtype, param_dtype=jnp.float32,
                 embedding_init=_init(dense_init, ("vocab", None if self.embed_dim else "embed")),
                 name="embed")(tokens)
    if self.embed_dim:  # A narrow embedding projected to the width (MD4's 64-d tokens).
      x = nn.Dense(self.model_dim, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32,
                   kernel_init=_init(dense_init, (None, "embed")), name="embed_proj")(x)
    x = _constrain(x, _HIDDEN)

    cond = None
    if self.time_conditioning == "adaln":
      alpha = jnp.asarray(alpha)
      if alpha.shape != (tokens.shape[0],):
        raise ValueError(f"alpha must have shape [B]=({tokens.shape[0]},), got {alpha.shape}")
      dense = lambda name, names: nn.Dense(self.model_dim, use_bias=False, dtype=self.dtype,
                                           param_dtype=jnp.float32,
                                           kernel_init=_init(dense_init, names), name=name)
      c = dense("time_in", ("time", "embed"))(timestep_features(alpha, self.model_dim))
      c = dense("time_out", ("time", "embed"))(nn.silu(c))
      # Every modulation Dense consumes silu(c), as in DiT; compute it once.
      cond = nn.silu(c)

    # RoPE's cos and sin, once for every layer: [B, L, Dh / 2], or [1, L, Dh / 2] by default.
    length, head_dim = tokens.shape[1], self.model_dim // self.num_heads
    rope = rope_cos_sin(np.arange(length)[None] if positions is None else positions, head_dim,
                        self.rope_base, num_positions=length)
    x = self._blocks(x, cond, mask, rope, segment_ids)

    x = _norm(self.norm, self.dtype, "final_norm")(x)
    if cond is not None:
      mod = nn.Dense(2 * self.model_dim, use_bias=False, dtype=self.dtype,
                     param_dtype=jnp.float32,
                     kernel_init=_init(nn.initializers.zeros, ("embed", "modulation")),
                     name="final_adaln")(cond)
      shift, scale = jnp.split(mod, 2, axis=-1)
      x = _modulate(x, shift, scale)
    output_init = nn.initializers.zeros if self.output_init == "zeros" else dense_init
    logits = nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype,
                      param_dtype=jnp.float32, kernel_init=_init(output_init, ("embed", "vocab")),
                      name="logits")(x)
    # The compute dtype: a float32 copy of [B, L, V] would dominate memory at V = 50k.
    return _constrain(logits, ("batch", "length", "vocab"))


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
