"""The network's building blocks: initializers, projections with logical axis names, the
gated MLP, norms, adaLN and time features (`md4jax.model.transformer` assembles them).

Every param and the main activations carry logical axis names ("embed", "heads", "mlp", ...);
`md4jax.runtime.sharding` maps them to mesh axes. Without a mesh in context the names change
nothing.
"""

import math

import flax.linen as nn
import jax.numpy as jnp

from md4jax.model import lora
from md4jax.model.projection import named_projection, project

# "normal": N(0, 0.02²), the matrices writing into the residual stream 0.02/√(2N) (GPT-2).
# "fan_in": truncated normal of variance 1/fan_in (LeCun, Flax's Dense default) for every
# matrix, N(0, 1/width) for the embedding (Flax's Embed default); "fan_in_mlp_depth": the same
# with the MLP's three matrices at variance (2/N)/fan_in (MD4's depth_scaled_init).
WEIGHT_INITS = ("normal", "fan_in", "fan_in_mlp_depth")
# Sinusoidal time features: "dit" [cos, sin] at frequencies 10000^(-i/half) (DiT's);
# "ddpm" [sin, cos] at 10000^(-i/(half-1)) (DDPM's, MD4's).
TIME_FEATURES = ("dit", "ddpm")
INIT_STD = 0.02

# Logical names of activations.
HIDDEN = ("batch", "length", "embed")
HEADS = ("batch", "length", "heads", "head_dim")


def logical_init(initializer, names):
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
      INIT_STD / math.sqrt(2 * num_layers) if writes_residual else INIT_STD
    )
  scale = 2.0 / num_layers if init == "fan_in_mlp_depth" and in_mlp else 1.0
  return nn.initializers.variance_scaling(
    scale, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes
  )


def embedding_init(init: str):
  """The token embedding's initializer under `init` (WEIGHT_INITS)."""
  if init == "normal":
    return nn.initializers.normal(INIT_STD)
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def kernel_param(module: nn.Module, shape: tuple, names: tuple, initializer):
  """The module's float32 param "kernel", from `initializer`, with logical axis names."""
  return module.param("kernel", logical_init(initializer, names), shape, jnp.float32)


def constrain(x, names):
  return nn.with_logical_constraint(x, names)


def timestep_features(time, dim, max_period=10000.0, style="dit"):
  """Sinusoidal features of a time value in [0, 1] (alpha(t) or t) [...] -> [..., dim] float32.

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
  args = 1000.0 * jnp.asarray(time, jnp.float32)[..., None] * freqs
  pair = (jnp.sin(args), jnp.cos(args)) if style == "ddpm" else (jnp.cos(args), jnp.sin(args))
  feats = jnp.concatenate(pair, axis=-1)
  if dim % 2:
    feats = jnp.pad(feats, ((0, 0),) * (feats.ndim - 1) + ((0, 1),))
  return feats


def per_position(modulation):
  """An adaLN modulation [B, D] (one per sequence) as [B, 1, D]; [B, L, D] (one per position) as
  it is."""
  return modulation[:, None, :] if modulation.ndim == 2 else modulation


def modulate(x, shift, scale):
  return x * (1 + per_position(scale)) + per_position(shift)


class Projection(nn.Module):
  """x [..., *in] -> [..., *out] by a float32 param "kernel" [*in, *out] (as nn.Dense's) with
  logical axis names, contracting x's last num_in dims (`projection.project`); with bias, plus a
  float32 param "bias" [*out] (zeros at init).

  With lora_rank r > 0, plus (lora_alpha / r) · (x · A) · B: float32 params "lora_a" A [*in, r]
  and "lora_b" B [r, *out] (zeros at init, so the output starts as the base one exactly;
  `md4jax.model.lora`).

  (nn.DenseGeneral initializes a flat kernel and reshapes it, which breaks the
  named-axis constraint flax applies when it checks an existing param's shape.)
  """

  shape: tuple
  num_in: int
  names: tuple
  initializer: object  # A JAX initializer of the kernel.
  dtype: jnp.dtype
  bias: bool = False
  lora_rank: int = 0  # Rank of the LoRA update; 0 = none.
  lora_alpha: float = lora.DEFAULT_ALPHA  # The LoRA update's scale is lora_alpha / lora_rank (> 0).

  @nn.compact
  def __call__(self, x):
    # The kernel first: params made after it take later rngs, so its init is the base one's.
    kernel = kernel_param(self, self.shape, self.names, self.initializer)
    out_shape, out_names = self.shape[self.num_in :], self.names[self.num_in :]
    bias = None
    if self.bias:
      bias = self.param(
        "bias", logical_init(nn.initializers.zeros, out_names), out_shape, jnp.float32
      )
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    out = named_projection(x, kernel, self.num_in)
    if self.lora_rank:
      out = out + self._lora_update(x, out_shape, out_names)
    if bias is None:
      return out
    return out + bias.astype(out.dtype)

  def _lora_update(self, x, out_shape: tuple, out_names: tuple):
    """(lora_alpha / r) · (x · A) · B, in the compute dtype."""
    in_shape, in_names = self.shape[: self.num_in], self.names[: self.num_in]
    a = self.param(
      lora.LORA_A,
      logical_init(lora.adapter_init(self.num_in), in_names + (lora.RANK_AXIS,)),
      in_shape + (self.lora_rank,),
      jnp.float32,
    )
    b = self.param(
      lora.LORA_B,
      logical_init(nn.initializers.zeros, (lora.RANK_AXIS,) + out_names),
      (self.lora_rank,) + out_shape,
      jnp.float32,
    )
    a, b = nn.dtypes.promote_dtype(a, b, dtype=self.dtype)
    # The factor on the [..., r] side: r multiplies instead of the output's width.
    down = named_projection(x, a, self.num_in) * jnp.asarray(
      lora.scale(self.lora_rank, self.lora_alpha), x.dtype
    )
    return project(down, b, 1)


class SwiGLU(nn.Module):
  """Gated MLP: W_down(silu(x W_gate) * (x W_up)), or with a sigmoid gate; no biases."""

  mlp_dim: int
  weight_init: str  # WEIGHT_INITS
  num_layers: int  # Of the whole network: the depth-scaled inits use it.
  dtype: jnp.dtype
  gate: str = "swiglu"
  lora_rank: int = 0  # LoRA adapters of this rank on gate, up and down (`Projection`); 0 = none.
  lora_alpha: float = lora.DEFAULT_ALPHA  # The LoRA update's scale is lora_alpha / lora_rank (> 0).

  @nn.compact
  def __call__(self, x):
    model_dim = x.shape[-1]
    lora_args = dict(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha)
    # W_gate and W_up as two matmuls (`project`): stacked into one [D, 2, F] kernel, every step
    # copied both kernels and concatenated the two gradients (slower; docs/performance.md).
    in_init = kernel_init(self.weight_init, self.num_layers, in_mlp=True)
    gate, up = (
      Projection(
        (model_dim, self.mlp_dim), 1, ("embed", "mlp"), in_init, self.dtype, **lora_args, name=name
      )(x)
      for name in ("gate", "up")
    )
    activation = nn.silu if self.gate == "swiglu" else nn.sigmoid
    hidden = constrain(activation(gate) * up, ("batch", "length", "mlp"))
    out_init = kernel_init(self.weight_init, self.num_layers, writes_residual=True, in_mlp=True)
    return Projection(
      (self.mlp_dim, model_dim), 1, ("mlp", "embed"), out_init, self.dtype, **lora_args, name="down"
    )(hidden)


def make_norm(kind, eps, dtype, name):
  if kind == "layer":
    return nn.LayerNorm(
      epsilon=eps, use_scale=False, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name
    )
  return nn.RMSNorm(
    epsilon=eps,
    dtype=dtype,
    param_dtype=jnp.float32,
    scale_init=logical_init(nn.initializers.ones, ("embed",)),
    name=name,
  )


def adaln_projection(num_outputs: int, cond_names: tuple, use_bias: bool, dtype, name: str):
  """The zero-initialized projection of the (activated) time embedding to num_outputs × D."""
  return nn.Dense(
    num_outputs,
    use_bias=use_bias,
    dtype=dtype,
    param_dtype=jnp.float32,
    kernel_init=logical_init(nn.initializers.zeros, cond_names + ("modulation",)),
    bias_init=logical_init(nn.initializers.zeros, ("modulation",)),
    name=name,
  )
