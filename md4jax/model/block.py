"""A Transformer block (pre-norm attention and gated MLP, optionally adaLN-Zero modulated) and
its forms under nn.scan and remat, for `md4jax.model.transformer`."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from md4jax.model import lora
from md4jax.model.attention import Attention
from md4jax.model.layers import (
  HIDDEN,
  SwiGLU,
  adaln_projection,
  constrain,
  make_norm,
  modulate,
  per_position,
)
from md4jax.model.projection import PROJECTION


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
  block_layout: tuple = ()  # Attention's.
  num_kv_heads: int = 0  # Attention's.
  qkv_bias: bool = False  # Attention's.
  lora_rank: int = 0  # LoRA adapters of this rank on the attention and MLP projections; 0 = none.
  lora_alpha: float = lora.DEFAULT_ALPHA  # The LoRA update's scale is lora_alpha / lora_rank (> 0).

  @nn.compact
  def __call__(self, x, cond, mask, rope, segment_ids=None, cache=None):
    """x [B, L, D]; cond [B, C] or [B, L, C] (the activated time embedding, one per sequence or
    per position) or None; mask, rope,
    segment_ids and cache as Attention takes them (with cache: returns (x, x's keys and values))."""
    model_dim = x.shape[-1]
    norm = lambda name: make_norm(self.norm, self.norm_eps, self.dtype, name)
    attn = Attention(
      self.num_heads,
      self.causal,
      self.weight_init,
      self.num_layers,
      self.dtype,
      self.attention,
      self.block_layout,
      self.num_kv_heads,
      self.qkv_bias,
      self.lora_rank,
      self.lora_alpha,
      name="attn",
    )
    mlp = SwiGLU(
      self.mlp_dim,
      self.weight_init,
      self.num_layers,
      self.dtype,
      self.mlp,
      self.lora_rank,
      self.lora_alpha,
      name="mlp",
    )
    kv = None

    def attend(h):
      nonlocal kv
      out = attn(h, rope, mask, segment_ids, cache)
      if cache is None:
        return out
      out, kv = out
      return out

    if cond is None:
      x = x + attend(norm("attn_norm")(x))
      x = constrain(x + mlp(norm("mlp_norm")(x)), HIDDEN)
      return x if cache is None else (x, kv)
    # Zero init: gates are 0, so the block starts as the identity and the
    # conditioning is learned in smoothly (adaLN-Zero, Peebles & Xie 2023).
    cond_names = ("embed" if cond.shape[-1] == model_dim else "time",)  # A narrower one: whole.
    mod = adaln_projection(6 * model_dim, cond_names, self.biases, self.dtype, "adaln")(cond)
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
    x = x + per_position(gate1) * attend(modulate(norm("attn_norm")(x), shift1, scale1))
    x = x + per_position(gate2) * mlp(modulate(norm("mlp_norm")(x), shift2, scale2))
    x = constrain(x, HIDDEN)
    return x if cache is None else (x, kv)


class ScannedBlock(nn.Module):
  """A Block in nn.scan's (carry, out) form: the residual stream is the carry."""

  block: type
  kwargs: dict

  @nn.compact
  def __call__(self, x, cond, mask, rope, segment_ids, cache):
    out = self.block(**self.kwargs, name="block")(x, cond, mask, rope, segment_ids, cache)
    return out if cache is not None else (out, None)


def remat_policy(remat: str):
  """jax.checkpoint policy: "full" saves nothing, "save_dots" keeps the weight matmuls' outputs
  (`project`'s by name: a policy does not see the matmul inside a custom_vjp)."""
  if remat == "full":
    return None
  policies = jax.checkpoint_policies
  return policies.save_from_both_policies(
    policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(PROJECTION)
  )
