"""Denoiser network: a pre-norm Transformer mapping (tokens, time) to logits.

This module holds no diffusion math. The same network serves as the
bidirectional masked-diffusion denoiser (`causal=False`, optionally conditioned
via adaLN-Zero on a time value: alpha(t) or t, whichever the caller passes) and
as the autoregressive baseline (`causal=True`).

Each of MD4's architectural choices is an attribute of its own (init, norm and
its eps, biases, gate, embedding width, time features and MLP, adaLN input
activation, output init); `md4jax.config`'s model.preset = "md4" sets them
all (docs/md4_parity.md).

Every param and the main activations carry logical axis names ("embed",
"heads", "mlp", ...); `md4jax.runtime.sharding` maps them to mesh axes. Without a
mesh in context the names change nothing.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from md4jax.model import lora
from md4jax.model.attention import segment_attention_mask, softmax_attention  # noqa: F401 (re-exported)
from md4jax.model.block import Block, ScannedBlock, remat_policy
from md4jax.model.layers import (
  HIDDEN,
  adaln_projection,
  constrain,
  embedding_init,
  kernel_init,
  logical_init,
  make_norm,
  modulate,
  timestep_features,
)
from md4jax.model.options import check_network
from md4jax.model.rope import rope_cos_sin
from md4jax.model.splash import splash_attention, splash_block_size  # noqa: F401 (re-exported)


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

  In causal mode with num_kv_heads, qkv_bias, tie_embeddings and rope_base set as theirs, the
  network is Hugging Face's Llama or Qwen2 (`md4jax.model.hf_tensors` maps the weights).

  With lora_rank > 0 every attention and MLP projection also holds LoRA adapters ("lora_a",
  "lora_b" beside its "kernel"; `md4jax.model.lora`): the base params keep their names and shapes.
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
  # (MD4's); the MLP and logits never have one, attention only through qkv_bias.
  biases: bool = False
  time_features: str = "dit"  # TIME_FEATURES
  time_dim: int = 0  # Width of the time features and embedding; 0 = model_dim.
  time_hidden_dim: int = 0  # Hidden width of the time MLP; 0 = the time embedding's width.
  adaln_activation: str = "silu"  # ADALN_ACTIVATIONS
  # Block diffusion (BD3-LM): a position in block k reads blocks <= k only, so a block never sees
  # what comes after it; 0 = none (every position reads every other).
  block_size: int = 0
  num_kv_heads: int = 0  # Key and value heads (grouped-query attention); 0 = num_heads.
  qkv_bias: bool = False  # A bias on the query, key and value projections (Qwen2's).
  # The logits read the embedding's first V rows (the mask row V is an input only) instead of a
  # logits layer of their own (Llama's and Qwen2's tie_word_embeddings).
  tie_embeddings: bool = False
  # A released dLLM's own mask id inside the vocabulary (LLaDA's 126336, Dream's 151666): its
  # logit is -inf, so the mask is never predicted (the mask input is row V, a copy of its row).
  checkpoint_mask_id: int = -1
  # Dream's logits: position i's are the last layer's output at position i − 1 (position 0 keeps
  # its own), so each position predicts the token after the one it reads, as the AR model it was
  # adapted from did.
  shift_logits: bool = False
  # LoRA (`md4jax.model.lora`): a rank-r update W + (lora_alpha / r)·A·B on every attention and
  # MLP projection, B zeros at init (the base network exactly); 0 = none.
  lora_rank: int = 0
  lora_alpha: float = lora.DEFAULT_ALPHA  # The LoRA update's scale is lora_alpha / lora_rank (> 0).
  # Self-conditioning (Analog Bits, CDCD): a call also reads `previous`, an earlier estimate of
  # x_0 [B, L, V], through the embedding of its expected token and a zero-initialized
  # projection (at init, and for previous = zeros, the network without it).
  self_condition: bool = False

  def _check_config(self, alpha):
    check_network(
      model_dim=self.model_dim,
      num_heads=self.num_heads,
      num_kv_heads=self.num_kv_heads,
      time_conditioning=self.time_conditioning,
      attention=self.attention,
      remat=self.remat,
      norm=self.norm,
      mlp=self.mlp,
      output_init=self.output_init,
      weight_init=self.weight_init,
      time_features=self.time_features,
      adaln_activation=self.adaln_activation,
      time_dim=self.time_dim,
      embed_dim=self.embed_dim,
      tie_embeddings=self.tie_embeddings,
      lora_rank=self.lora_rank,
      lora_alpha=self.lora_alpha,
    )
    if self.time_conditioning == "adaln" and alpha is None:
      raise ValueError("time_conditioning='adaln' requires alpha, got None")

  def _block_layout(self, length: int, clean) -> tuple:
    """Attention's block_layout for a call on `length` tokens (with clean: two streams)."""
    if not self.block_size:
      if clean is not None:
        raise ValueError("clean (block diffusion's training pass) needs block_size > 0")
      return ()
    if self.causal or length % self.block_size:
      raise ValueError(
        f"block_size {self.block_size} needs a bidirectional network (causal=False) and a "
        f"length it divides, got causal={self.causal}, length {length}"
      )
    return (self.block_size, clean is not None)

  def _blocks(self, x, cond, mask, rope, segment_ids, block_layout, cache=None):
    """x after every block; with cache (keys, values [N, B, C, Hkv, Dh], valid [C]): (x, the
    blocks' own keys and values [N, B, L, Hkv, Dh])."""
    kwargs = dict(
      block_layout=block_layout,
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
      num_kv_heads=self.num_kv_heads,
      qkv_bias=self.qkv_bias,
      lora_rank=self.lora_rank,
      lora_alpha=self.lora_alpha,
    )
    block = Block
    if self.remat != "none":
      # Under scan, the loop already keeps XLA from merging recomputation into the forward pass.
      block = nn.remat(Block, policy=remat_policy(self.remat), prevent_cse=not self.scan_layers)
    layer_caches = None
    if cache is not None:
      keys, values, valid = cache
      layer_caches = (keys, values, jnp.broadcast_to(valid, (self.num_layers, *valid.shape)))
    if not self.scan_layers:
      new_kv = []
      for i in range(self.num_layers):
        layer_cache = None if cache is None else jax.tree.map(lambda a, i=i: a[i], layer_caches)
        x = block(**kwargs, name=f"block_{i}")(x, cond, mask, rope, segment_ids, layer_cache)
        if cache is not None:
          x, kv = x
          new_kv.append(kv)
      if cache is None:
        return x
      return x, jax.tree.map(lambda *a: jnp.stack(a), *new_kv)
    scanned = nn.scan(
      ScannedBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast,) * 4 + (0,),
      length=self.num_layers,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, new_kv = scanned(block, kwargs, name="blocks")(
      x, cond, mask, rope, segment_ids, layer_caches
    )
    return x if cache is None else (x, new_kv)

  def _estimate_embedding(self, previous, embed, shape, embed_dim):
    """The embedding of previous's expected token, projected by a zero-initialized matrix (0 for
    previous None)."""
    if previous is None:
      estimate = jnp.zeros((*shape, embed_dim), self.dtype)
    else:
      previous = jnp.asarray(previous)
      if previous.shape != (*shape, self.vocab_size):
        raise ValueError(
          f"previous must be [B, L, V]={(*shape, self.vocab_size)}, got {previous.shape}"
        )
      table = embed.embedding[: self.vocab_size].astype(self.dtype)
      estimate = jnp.einsum("blv,vd->bld", previous.astype(self.dtype), table)
    return nn.Dense(
      embed_dim,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=logical_init(nn.initializers.zeros, (None, None)),
      name="self_condition",
    )(estimate)

  @nn.compact
  def __call__(
    self,
    tokens,
    alpha=None,
    segment_ids=None,
    positions=None,
    clean=None,
    cache=None,
    attention_mask=None,
    previous=None,
  ):
    """tokens [B, L] int32; alpha [B] float or None: the time value per sequence, alpha(t) or t
    (`md4jax.training.objective.denoiser` passes what config.model.time_input names); or [B, L]:
    one per position (adaLN modulates each position by its own: block diffusion of the
    uniform-state process, whose blocks are at different noise levels).

    segment_ids [B, L] int (1, 2, ... per packed document, 0 = padding) or None:
    given, a position attends only to positions of its own nonzero segment.
    positions [B, L] int in [0, L) (restarting per document) or None (0 .. L-1) feed RoPE.
    clean [B, L] int (block_size > 0): BD3-LM's training pass. The network reads tokens (z_t)
    and clean (x) together, each noisy block its own noisy tokens and the clean blocks before it
    (`attention.block_pattern`), and returns the logits of every noisy block at once: what one
    call per block, each on the clean prefix and the noisy block, would give. A time-conditioned
    network takes alpha [B, L] (each noisy position's; the clean stream reads α = 1, as a clean
    prefix does in a call per block, or a cached block).
    cache {"k", "v": [N, B, C, Hkv, Dh], "valid": [C] bool} (block diffusion's sampler): tokens
    are one block at absolute positions (given, any size) that reads the valid cached keys and
    values and itself; returns (logits, {"k", "v": the block's own, [N, B, L, Hkv, Dh]}).
    attention_mask [L, L] or [B, L, L] bool or None: where query i may read key j besides
    what segment_ids allow (the caller's pattern, e.g. an annealed causal mask,
    `md4jax.training.adaptation`); not with clean, cache or the splash kernel.
    previous [B, L, V] float or None (self_condition only): the probabilities of an earlier
    estimate of x_0 per position; zeros or None: no estimate.
    """
    self._check_config(alpha)
    chex.assert_rank(tokens, 2, custom_message="Transformer: tokens must be [B, L]")
    chex.assert_type(tokens, int, custom_message="Transformer: tokens must be integer ids")
    length = tokens.shape[1]
    if cache is not None and self.shift_logits:
      raise ValueError("shift_logits reads the position before each one: no cached block calls")
    if cache is not None and (clean is not None or segment_ids is not None or positions is None):
      raise ValueError("cache takes one block with its positions, without clean or segment_ids")
    block_layout = () if cache is not None else self._block_layout(length, clean)
    if clean is not None:
      if jnp.shape(clean) != tokens.shape:
        raise ValueError(
          f"clean must have the tokens' shape {tokens.shape}, got {jnp.shape(clean)}"
        )
      tokens = jnp.concatenate([tokens, jnp.asarray(clean, tokens.dtype)], axis=1)
      if self.time_conditioning != "none":
        alpha = jnp.asarray(alpha)
        if alpha.shape != (tokens.shape[0], length):
          raise ValueError(
            f"clean with time conditioning takes alpha [B, L]=({tokens.shape[0]}, {length}) "
            f"(each noisy position's), got {alpha.shape}"
          )
        alpha = jnp.concatenate([alpha, jnp.ones_like(alpha)], axis=1)  # The clean stream: α = 1.
      if segment_ids is not None:
        segment_ids = jnp.tile(jnp.asarray(segment_ids), (1, 2))
      if positions is not None:
        positions = jnp.tile(jnp.asarray(positions), (1, 2))
    mask = None
    if segment_ids is not None:
      segment_ids = jnp.asarray(segment_ids)
      if segment_ids.shape != tokens.shape:
        raise ValueError(
          f"segment_ids must have the tokens' shape {tokens.shape}, got {segment_ids.shape}"
        )
      if self.attention != "splash":
        mask = segment_attention_mask(segment_ids)
    if attention_mask is not None:
      if clean is not None or cache is not None or self.attention == "splash":
        raise ValueError("attention_mask takes one stream without a cache, not splash attention")
      allowed = jnp.asarray(attention_mask, bool)
      if allowed.shape[-2:] != (length, length) or allowed.ndim not in (2, 3):
        raise ValueError(f"attention_mask must be [L, L] or [B, L, L], L={length}: {allowed.shape}")
      allowed = allowed.reshape((-1, 1, length, length))  # [B or 1, 1, L, L], as the heads see it.
      mask = allowed if mask is None else mask & allowed
    if positions is not None and jnp.shape(positions) != tokens.shape:  # (Tiled with clean.)
      raise ValueError(
        f"positions must have the tokens' shape {tokens.shape}, got {jnp.shape(positions)}"
      )
    if cache is None and positions is not None and not isinstance(positions, jax.core.Tracer):
      # Traced positions out of range give NaN logits (rope_cos_sin); known ones are refused here.
      known = np.asarray(positions)
      outside = known[(known < 0) | (known >= length)]
      if outside.size:
        raise ValueError(
          f"positions must lie in [0, {length}) (the sequence length), "
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
        kernel_init=logical_init(dense_init, names),
        bias_init=logical_init(nn.initializers.zeros, names[-1:]),
        name=name,
      )

    # V + 1 rows: the extra row is the mask token (input only).
    embed_dim = self.embed_dim or self.model_dim
    embed = nn.Embed(
      self.vocab_size + 1,
      embed_dim,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=logical_init(
        embedding_init(self.weight_init), ("vocab", None if self.embed_dim else "embed")
      ),
      name="embed",
    )
    x = embed(tokens)
    if previous is not None and not self.self_condition:
      raise ValueError("previous (an estimate of x_0) needs a network with self_condition=True")
    if self.self_condition:
      if clean is not None:
        raise ValueError("self_condition reads one stream: not with clean (block diffusion)")
      x = x + self._estimate_embedding(previous, embed, tokens.shape, embed_dim)
    if self.embed_dim:  # A narrow embedding projected to the width (MD4's 64-d tokens).
      x = dense(self.model_dim, (None, "embed"), "embed_proj")(x)
    x = constrain(x, HIDDEN)

    cond = None
    if self.time_conditioning == "adaln":
      alpha = jnp.asarray(alpha)
      if alpha.shape not in ((tokens.shape[0],), tokens.shape):
        raise ValueError(
          f"alpha must have shape [B]=({tokens.shape[0]},) or [B, L]={tokens.shape}, got "
          f"{alpha.shape}"
        )
      width = self.time_dim or self.model_dim
      hidden = self.time_hidden_dim or width
      c = dense(hidden, ("time", width_name(hidden)), "time_in")(
        timestep_features(alpha, width, style=self.time_features)
      )
      c = dense(width, ("time", width_name(width)), "time_out")(nn.silu(c))
      # Every modulation Dense reads the same activated embedding (DiT: silu); compute it once.
      cond = nn.silu(c) if self.adaln_activation == "silu" else nn.sigmoid(c)

    # RoPE's cos and sin, once for every layer: [B, L, Dh / 2], or [1, L, Dh / 2] by default.
    head_dim = self.model_dim // self.num_heads
    if positions is None:
      positions = np.arange(tokens.shape[1])[None] % length  # The clean stream's repeat z_t's.
    if cache is None:
      rope = rope_cos_sin(positions, head_dim, self.rope_base, num_positions=length)
      x = self._blocks(x, cond, mask, rope, segment_ids, block_layout)
    else:  # Positions past any table: cos and sin evaluated in the network.
      rope = rope_cos_sin(positions, head_dim, self.rope_base)
      x, new_kv = self._blocks(
        x, cond, mask, rope, segment_ids, block_layout, (cache["k"], cache["v"], cache["valid"])
      )
    x = x[:, :length]  # With clean: the noisy stream's.
    if cond is not None and cond.ndim == 3:
      cond = cond[:, :length]

    x = make_norm(self.norm, self.norm_eps, self.dtype, "final_norm")(x)
    if cond is not None:
      cond_names = ("embed" if cond.shape[-1] == self.model_dim else "time",)
      mod = adaln_projection(
        2 * self.model_dim, cond_names, self.biases, self.dtype, "final_adaln"
      )(cond)
      shift, scale = jnp.split(mod, 2, axis=-1)
      x = modulate(x, shift, scale)
    if self.shift_logits:
      # Dream's shift on the final hidden state [B, L, D], before the projection: the same logits
      # as shifting them, without a copy of [B, L, V] (V = 152064 for Dream).
      x = jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)
    if self.tie_embeddings:
      x, table = nn.dtypes.promote_dtype(x, embed.embedding[: self.vocab_size], dtype=self.dtype)
      logits = jnp.einsum("bld,vd->blv", x, table)
    else:
      output_init = nn.initializers.zeros if self.output_init == "zeros" else dense_init
      logits = nn.Dense(
        self.vocab_size,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=jnp.float32,
        kernel_init=logical_init(output_init, ("embed", "vocab")),
        name="logits",
      )(x)
    if self.checkpoint_mask_id >= 0:
      logits = logits.at[..., self.checkpoint_mask_id].set(-jnp.inf)
    # The compute dtype: a float32 copy of [B, L, V] would dominate memory at V = 50k.
    logits = constrain(logits, ("batch", "length", "vocab"))
    return logits if cache is None else (logits, {"k": new_kv[0], "v": new_kv[1]})


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
