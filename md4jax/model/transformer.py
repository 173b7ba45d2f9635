"""Denoiser network: a pre-norm Transformer mapping (tokens, time) to logits.

This module holds no diffusion math. The same network serves as the
bidirectional masked-diffusion denoiser (`causal=False`, optionally conditioned
via adaLN-Zero on a time value: alpha(t) or t, whichever the caller passes) and
as the autoregressive baseline (`causal=True`).

Each of MD4's architectural choices is an attribute of its own (init, norm and
its eps, biases, gate, embedding width, time features and MLP, adaLN input
activation, output init); `md4jax.config_lib`'s model.preset = "md4" sets them
all (docs/md4_parity.md).

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
from md4jax.model.splash import splash_attention, splash_block_size  # noqa: F401 (re-exported)

ATTENTIONS = ("xla", "cudnn", "splash")
REMATS = ("none", "full", "save_dots")
NORMS = ("rms", "layer")  # RMSNorm with a learned scale; LayerNorm without scale or bias (MD4's).
MLPS = ("swiglu", "sigmoid_glu")  # Gate silu(x W_g) or sigmoid(x W_g), times x W_up.
# The logits layer: weight_init's plain-matrix init, or zeros (MD4's: uniform predictions at init).
OUTPUT_INITS = ("normal", "zeros")
# "normal": N(0, 0.02²), the matrices writing into the residual stream 0.02/√(2N) (GPT-2).
# "fan_in": truncated normal of variance 1/fan_in (LeCun, Flax's Dense default) for every
# matrix, N(0, 1/width) for the embedding (Flax's Embed default); "fan_in_mlp_depth": the same
# with the MLP's three matrices at variance (2/N)/fan_in (MD4's depth_scaled_init).
WEIGHT_INITS = ("normal", "fan_in", "fan_in_mlp_depth")
# Sinusoidal time features: "dit" [cos, sin] at frequencies 10000^(-i/half) (DiT's);
# "ddpm" [sin, cos] at 10000^(-i/(half-1)) (DDPM's, MD4's).
TIME_FEATURES = ("dit", "ddpm")
ADALN_ACTIVATIONS = (
  "silu",
  "sigmoid",
)  # Applied to the time embedding before every adaLN projection.
_TIME_CONDITIONINGS = ("none", "adaln")
_INIT_STD = 0.02

# Logical names of activations.
_HIDDEN = ("batch", "length", "embed")
_HEADS = ("batch", "length", "heads", "head_dim")


def _init(initializer, names):
  """An initializer whose param carries logical axis names (for sharding)."""
  return nn.with_logical_partitioning(initializer, names)


def kernel_init(
  init: str,
  num_layers: int,
  in_axes=-2,
  out_axes=-1,
  *,
  writes_residual: bool = False,
  in_mlp: bool = False,
):
  """The initializer of a weight matrix under `init` (WEIGHT_INITS), its input dims in_axes.

  writes_residual: the matrix writes into the residual stream (attention out, MLP down);
  in_mlp: one of the MLP's three matrices.
  """
  if init == "normal":
    return nn.initializers.normal(
      _INIT_STD / math.sqrt(2 * num_layers) if writes_residual else _INIT_STD
    )
  scale = 2.0 / num_layers if init == "fan_in_mlp_depth" and in_mlp else 1.0
  return nn.initializers.variance_scaling(
    scale, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes
  )


def embedding_init(init: str):
  """The token embedding's initializer under `init` (WEIGHT_INITS)."""
  if init == "normal":
    return nn.initializers.normal(_INIT_STD)
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def _kernel(module: nn.Module, shape: tuple, names: tuple, initializer):
  """The module's float32 param "kernel", from `initializer`, with logical axis names."""
  return module.param("kernel", _init(initializer, names), shape, jnp.float32)


def _constrain(x, names):
  return nn.with_logical_constraint(x, names)


def timestep_features(time, dim, max_period=10000.0, style="dit"):
  """Sinusoidal features of a time value in [0, 1] (alpha(t) or t) [B] -> [B, dim] float32.

  The value is scaled by 1000 first so that the [0, 1] range spans many periods of
  the fastest frequencies (as diffusion models do with integer timesteps). style
  (TIME_FEATURES): "dit" [cos, sin] at frequencies max_period^(-i/half); "ddpm"
  [sin, cos] at max_period^(-i/(half-1)), evaluated in float32 in DDPM's order
  (dim >= 4).
  """
  half = dim // 2
  if style == "ddpm":
    step = jnp.log(jnp.float32(max_period)) / (half - 1)
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -step)
  else:
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = 1000.0 * jnp.asarray(time, jnp.float32)[:, None] * freqs
  pair = (jnp.sin(args), jnp.cos(args)) if style == "ddpm" else (jnp.cos(args), jnp.sin(args))
  feats = jnp.concatenate(pair, axis=-1)
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
  initializer: object  # A JAX initializer of the kernel.
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    kernel = _kernel(self, self.shape, self.names, self.initializer)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    return named_projection(x, kernel, self.num_in)


class Attention(nn.Module):
  """Multi-head self-attention with RoPE; no biases."""

  num_heads: int
  causal: bool
  weight_init: str  # WEIGHT_INITS
  num_layers: int  # Of the whole network: the depth-scaled inits use it.
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
    qkv = _Projection(
      (model_dim, 3, self.num_heads, head_dim),
      1,
      ("embed", "qkv", "heads", "head_dim"),
      kernel_init(self.weight_init, self.num_layers, 0, (1, 2, 3)),
      self.dtype,
      name="qkv",
    )(x)
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
      out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=self.causal, implementation="cudnn"
      )
    else:
      out = softmax_attention(q, k, v, mask, self.causal)
    out = _constrain(out, _HEADS)
    out_init = kernel_init(self.weight_init, self.num_layers, (0, 1), 2, writes_residual=True)
    return _Projection(
      (self.num_heads, head_dim, model_dim),
      2,
      ("heads", "head_dim", "embed"),
      out_init,
      self.dtype,
      name="out",
    )(out)


class SwiGLU(nn.Module):
  """Gated MLP: W_down(silu(x W_gate) * (x W_up)), or with a sigmoid gate; no biases."""

  mlp_dim: int
  weight_init: str  # WEIGHT_INITS
  num_layers: int  # Of the whole network: the depth-scaled inits use it.
  dtype: jnp.dtype
  gate: str = "swiglu"

  @nn.compact
  def __call__(self, x):
    model_dim = x.shape[-1]
    # W_gate and W_up as two matmuls (`project`): stacked into one [D, 2, F] kernel, every step
    # copied both kernels and concatenated the two gradients (4x256 step: 4% slower).
    in_init = kernel_init(self.weight_init, self.num_layers, in_mlp=True)
    gate, up = (
      _Projection((model_dim, self.mlp_dim), 1, ("embed", "mlp"), in_init, self.dtype, name=name)(x)
      for name in ("gate", "up")
    )
    activation = nn.silu if self.gate == "swiglu" else nn.sigmoid
    hidden = _constrain(activation(gate) * up, ("batch", "length", "mlp"))
    out_init = kernel_init(self.weight_init, self.num_layers, writes_residual=True, in_mlp=True)
    return _Projection(
      (self.mlp_dim, model_dim), 1, ("mlp", "embed"), out_init, self.dtype, name="down"
    )(hidden)


def _norm(kind, eps, dtype, name):
  if kind == "layer":
    return nn.LayerNorm(
      epsilon=eps, use_scale=False, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name
    )
  return nn.RMSNorm(
    epsilon=eps,
    dtype=dtype,
    param_dtype=jnp.float32,
    scale_init=_init(nn.initializers.ones, ("embed",)),
    name=name,
  )


def _adaln(num_outputs: int, cond_names: tuple, use_bias: bool, dtype, name: str):
  """The zero-initialized projection of the (activated) time embedding to num_outputs × D."""
  return nn.Dense(
    num_outputs,
    use_bias=use_bias,
    dtype=dtype,
    param_dtype=jnp.float32,
    kernel_init=_init(nn.initializers.zeros, cond_names + ("modulation",)),
    bias_init=_init(nn.initializers.zeros, ("modulation",)),
    name=name,
  )


class Block(nn.Module):
  """Pre-norm Transformer block, optionally adaLN-Zero modulated by `cond`."""

  num_heads: int
  mlp_dim: int
  causal: bool
  weight_init: str  # WEIGHT_INITS
  num_layers: int  # Of the whole network: the depth-scaled inits use it.
  dtype: jnp.dtype
  attention: str = "xla"
  norm: str = "rms"
  norm_eps: float = 1e-6
  mlp: str = "swiglu"
  biases: bool = False  # A bias on the adaLN projection.

  @nn.compact
  def __call__(self, x, cond, mask, rope, segment_ids=None):
    """x [B, L, D]; cond [B, C] (the activated time embedding) or None; mask, rope and
    segment_ids as Attention takes them."""
    model_dim = x.shape[-1]
    norm = lambda name: _norm(self.norm, self.norm_eps, self.dtype, name)
    attn = Attention(
      self.num_heads,
      self.causal,
      self.weight_init,
      self.num_layers,
      self.dtype,
      self.attention,
      name="attn",
    )
    mlp = SwiGLU(self.mlp_dim, self.weight_init, self.num_layers, self.dtype, self.mlp, name="mlp")
    if cond is None:
      x = x + attn(norm("attn_norm")(x), rope, mask, segment_ids)
      return _constrain(x + mlp(norm("mlp_norm")(x)), _HIDDEN)
    # Zero init: gates are 0, so the block starts as the identity and the
    # conditioning is learned in smoothly (adaLN-Zero, Peebles & Xie 2023).
    cond_names = ("embed" if cond.shape[-1] == model_dim else "time",)  # A narrower one: whole.
    mod = _adaln(6 * model_dim, cond_names, self.biases, self.dtype, "adaln")(cond)
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
    x = x + gate1[:, None, :] * attn(
      _modulate(norm("attn_norm")(x), shift1, scale1), rope, mask, segment_ids
    )
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
  return policies.save_from_both_policies(
    policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(PROJECTION)
  )


class Transformer(nn.Module):
  """Denoiser: tokens [B, L] in [0, V] (V = mask id) -> logits [B, L, V] in the compute dtype.

  Embedding init is normal(0.02) by default (GPT-2 style): with pre-norm blocks the
  residual-stream scale does not affect the normalized inputs, and small
  embeddings keep the residual contributions of the blocks comparable.

  With time_conditioning "adaln" the time value (alpha(t) or t: the caller's choice) goes
  through sinusoidal features (time_features, time_dim wide), a two-layer MLP (time_dim ->
  time_hidden_dim -> time_dim, silu between), then adaln_activation, and every adaLN
  projection reads the result.

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
  weight_init: str = "normal"  # WEIGHT_INITS
  norm_eps: float = 1e-6  # The eps of every norm (MD4: 1e-5).
  # A bias on the embedding projection, the time MLP's two layers and every adaLN projection
  # (MD4's); attention, MLP and logits never have one.
  biases: bool = False
  time_features: str = "dit"  # TIME_FEATURES
  time_dim: int = 0  # Width of the time features and embedding; 0 = model_dim.
  time_hidden_dim: int = 0  # Hidden width of the time MLP; 0 = the time embedding's width.
  adaln_activation: str = "silu"  # ADALN_ACTIVATIONS

  def _check_config(self, alpha):
    if self.time_conditioning not in _TIME_CONDITIONINGS:
      raise ValueError(
        f"unknown time_conditioning {self.time_conditioning!r}; "
        f"expected one of {_TIME_CONDITIONINGS}"
      )
    if self.attention not in ATTENTIONS:
      raise ValueError(f"unknown attention {self.attention!r}; expected one of {ATTENTIONS}")
    for name, value, valid in (
      ("remat", self.remat, REMATS),
      ("norm", self.norm, NORMS),
      ("mlp", self.mlp, MLPS),
      ("output_init", self.output_init, OUTPUT_INITS),
      ("weight_init", self.weight_init, WEIGHT_INITS),
      ("time_features", self.time_features, TIME_FEATURES),
      ("adaln_activation", self.adaln_activation, ADALN_ACTIVATIONS),
    ):
      if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; expected one of {valid}")
    time_width = self.time_dim or self.model_dim
    if self.time_features == "ddpm" and time_width < 4:
      raise ValueError(f"time_features='ddpm' needs a time width >= 4, got {time_width}")
    if self.model_dim % self.num_heads:
      raise ValueError(f"model_dim {self.model_dim} is not divisible by num_heads {self.num_heads}")
    head_dim = self.model_dim // self.num_heads
    if head_dim % 2:
      raise ValueError(f"head dim {head_dim} (model_dim / num_heads) must be even for RoPE")
    if self.time_conditioning == "adaln" and alpha is None:
      raise ValueError("time_conditioning='adaln' requires alpha, got None")

  def _blocks(self, x, cond, mask, rope, segment_ids):
    kwargs = dict(
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      causal=self.causal,
      weight_init=self.weight_init,
      num_layers=self.num_layers,
      dtype=self.dtype,
      attention=self.attention,
      norm=self.norm,
      norm_eps=self.norm_eps,
      mlp=self.mlp,
      biases=self.biases,
    )
    block = Block
    if self.remat != "none":
      # Under scan, the loop already keeps XLA from merging recomputation into the forward pass.
      block = nn.remat(Block, policy=_remat_policy(self.remat), prevent_cse=not self.scan_layers)
    if not self.scan_layers:
      for i in range(self.num_layers):
        x = block(**kwargs, name=f"block_{i}")(x, cond, mask, rope, segment_ids)
      return x
    scanned = nn.scan(
      _ScannedBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,) * 4,
      length=self.num_layers,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = scanned(block, kwargs, name="blocks")(x, cond, mask, rope, segment_ids)
    return x

  @nn.compact
  def __call__(self, tokens, alpha=None, segment_ids=None, positions=None):
    """tokens [B, L] int32; alpha [B] float or None: the time value per sequence, alpha(t) or t
    (`md4jax.training.objective.denoiser` passes what config.model.time_input names).

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
        raise ValueError(
          f"segment_ids must have the tokens' shape {tokens.shape}, got {segment_ids.shape}"
        )
      if self.attention != "splash":
        mask = segment_attention_mask(segment_ids)
    if positions is not None and jnp.shape(positions) != tokens.shape:
      raise ValueError(
        f"positions must have the tokens' shape {tokens.shape}, got {jnp.shape(positions)}"
      )
    if positions is not None and not isinstance(positions, jax.core.Tracer):
      # Traced positions out of range give NaN logits (rope_cos_sin); known ones are refused here.
      known = np.asarray(positions)
      outside = known[(known < 0) | (known >= tokens.shape[1])]
      if outside.size:
        raise ValueError(
          f"positions must lie in [0, {tokens.shape[1]}) (the sequence length), "
          f"got {outside.ravel()[:5].tolist()}"
        )
    dense_init = kernel_init(self.weight_init, self.num_layers)
    # An axis of the model's width is "embed" (sharded by FSDP); another one stays whole.
    width_name = lambda width: "embed" if width == self.model_dim else None

    def dense(features, names, name):
      return nn.Dense(
        features,
        use_bias=self.biases,
        dtype=self.dtype,
        param_dtype=jnp.float32,
        kernel_init=_init(dense_init, names),
        bias_init=_init(nn.initializers.zeros, names[-1:]),
        name=name,
      )

    # V + 1 rows: the extra row is the mask token (input only).
    embed_dim = self.embed_dim or self.model_dim
    x = nn.Embed(
      self.vocab_size + 1,
      embed_dim,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=_init(
        embedding_init(self.weight_init), ("vocab", None if self.embed_dim else "embed")
      ),
      name="embed",
    )(tokens)
    if self.embed_dim:  # A narrow embedding projected to the width (MD4's 64-d tokens).
      x = dense(self.model_dim, (None, "embed"), "embed_proj")(x)
    x = _constrain(x, _HIDDEN)

    cond = None
    if self.time_conditioning == "adaln":
      alpha = jnp.asarray(alpha)
      if alpha.shape != (tokens.shape[0],):
        raise ValueError(f"alpha must have shape [B]=({tokens.shape[0]},), got {alpha.shape}")
      width = self.time_dim or self.model_dim
      hidden = self.time_hidden_dim or width
      c = dense(hidden, ("time", width_name(hidden)), "time_in")(
        timestep_features(alpha, width, style=self.time_features)
      )
      c = dense(width, ("time", width_name(width)), "time_out")(nn.silu(c))
      # Every modulation Dense reads the same activated embedding (DiT: silu); compute it once.
      cond = nn.silu(c) if self.adaln_activation == "silu" else nn.sigmoid(c)

    # RoPE's cos and sin, once for every layer: [B, L, Dh / 2], or [1, L, Dh / 2] by default.
    length, head_dim = tokens.shape[1], self.model_dim // self.num_heads
    rope = rope_cos_sin(
      np.arange(length)[None] if positions is None else positions,
      head_dim,
      self.rope_base,
      num_positions=length,
    )
    x = self._blocks(x, cond, mask, rope, segment_ids)

    x = _norm(self.norm, self.norm_eps, self.dtype, "final_norm")(x)
    if cond is not None:
      cond_names = ("embed" if cond.shape[-1] == self.model_dim else "time",)
      mod = _adaln(2 * self.model_dim, cond_names, self.biases, self.dtype, "final_adaln")(cond)
      shift, scale = jnp.split(mod, 2, axis=-1)
      x = _modulate(x, shift, scale)
    output_init = nn.initializers.zeros if self.output_init == "zeros" else dense_init
    logits = nn.Dense(
      self.vocab_size,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=_init(output_init, ("embed", "vocab")),
      name="logits",
    )(x)
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
