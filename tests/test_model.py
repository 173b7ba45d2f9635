"""Tests for md4jax.model.transformer: shapes/dtypes, masking direction, adaLN-Zero, RoPE, remat/scan, splash."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.app import costs
from md4jax.model.transformer import (
  Transformer,
  count_params,
  flops_per_token,
  segment_attention_mask,
  softmax_attention,
  splash_attention,
  splash_block_size,
  timestep_features,
)

V, B, L = 11, 2, 8


def _model(**kw):
  cfg = dict(vocab_size=V, num_layers=2, model_dim=32, num_heads=4, mlp_dim=64)
  cfg.update(kw)
  return Transformer(**cfg)


def init(model, *args):
  """The model's variables with the logical-axis boxes removed (plain arrays)."""
  return nn.meta.unbox(model.init(*args))


def _tokens(seed=0):
  # Ids in [0, V] inclusive: V is the mask id and must be a valid input.
  return jax.random.randint(jax.random.key(seed), (B, L), 0, V + 1, dtype=jnp.int32)


def _alpha(value=0.3):
  return jnp.full((B,), value, jnp.float32)


@jax.jit  # One compiled call, not one per leaf.
def _perturb(params, scale=0.1, seed=123):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [p + scale * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, noisy)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("time_conditioning", ["none", "adaln"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shape_dtype(causal, time_conditioning, dtype):
  model = _model(causal=causal, time_conditioning=time_conditioning, dtype=dtype)
  tokens = _tokens()
  tokens = tokens.at[0, 0].set(V)  # make sure the mask id is present
  alpha = _alpha() if time_conditioning == "adaln" else None
  params = init(model, jax.random.key(1), tokens, alpha)
  logits = model.apply(params, tokens, alpha)
  # Last dim is the clean vocabulary: no logit for the mask id.
  assert logits.shape == (B, L, V)
  assert logits.dtype == dtype  # The compute dtype: no float32 copy of [B, L, V] in bfloat16.
  assert bool(jnp.all(jnp.isfinite(logits)))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  # The embedding has one extra row for the mask id.
  assert params["params"]["embed"]["embedding"].shape == (V + 1, 32)


def test_causal_masking():
  model = _model(causal=True)
  tokens = _tokens()
  params = init(model, jax.random.key(1), tokens)
  j = 5
  changed = tokens.at[:, j].set((tokens[:, j] + 1) % (V + 1))
  a, b = model.apply(params, tokens), model.apply(params, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :j]), np.asarray(b[:, :j]))
  assert bool(jnp.all(jnp.abs(a[:, j] - b[:, j]).max(axis=-1) > 1e-4))


def test_bidirectional_sees_future():
  model = _model(causal=False)
  tokens = _tokens()
  params = init(model, jax.random.key(1), tokens)
  j = L - 1
  changed = tokens.at[:, j].set((tokens[:, j] + 1) % (V + 1))
  a, b = model.apply(params, tokens), model.apply(params, changed)
  # Every earlier position in every sequence is affected by the last token.
  assert bool(jnp.all(jnp.abs(a[:, :j] - b[:, :j]).max(axis=-1) > 1e-4))


def test_adaln_zero_init_ignores_alpha_until_trained():
  model = _model(time_conditioning="adaln")
  tokens = _tokens()
  params = init(model, jax.random.key(1), tokens, _alpha(0.1))
  lo, hi = _alpha(0.1), _alpha(0.9)
  np.testing.assert_array_equal(
    np.asarray(model.apply(params, tokens, lo)), np.asarray(model.apply(params, tokens, hi))
  )
  # The zero-initialized modulation is what makes it exact.
  assert not any(bool(jnp.any(k)) for k in jax.tree.leaves(params["params"]["block_0"]["adaln"]))
  noisy = _perturb(params)
  diff = jnp.abs(model.apply(noisy, tokens, lo) - model.apply(noisy, tokens, hi)).max()
  assert float(diff) > 1e-3


def test_none_conditioning_ignores_alpha():
  model = _model()
  tokens = _tokens()
  params = init(model, jax.random.key(1), tokens)
  assert "time_in" not in params["params"]
  np.testing.assert_array_equal(
    np.asarray(model.apply(params, tokens)), np.asarray(model.apply(params, tokens, _alpha(0.5)))
  )


def test_positions_outside_the_sequence_are_refused():
  model = _model()
  params = init(model, jax.random.key(0), _tokens())
  for bad in (L, -1):
    positions = jnp.zeros((B, L), jnp.int32).at[1, 3].set(bad)
    with pytest.raises(ValueError, match=rf"positions must lie in \[0, {L}\).*{bad}"):
      model.apply(params, _tokens(), None, None, positions)


def _reference_forward(params, tokens, positions, causal):
  """The plain Transformer from its params: one matmul per kernel (W_gate and W_up apart), RoPE
  on q and k one at a time as a complex rotation, jax.nn attention. Pins the model's fused forms."""

  def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

  def rope(x):  # [B, L, H, Dh]: (x1 + i x2) e^{i θ}, θ_j = position · 10000^(-j / half).
    half = x.shape[-1] // 2
    theta = positions[:, :, None, None] * 10000.0 ** (-jnp.arange(half) / half)
    rotated = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * theta)
    return jnp.concatenate([rotated.real, rotated.imag], -1)

  p = params["params"]
  x = p["embed"]["embedding"][tokens]
  for i in range(len([name for name in p if name.startswith("block_")])):
    block = p[f"block_{i}"]
    h = rms(x, block["attn_norm"]["scale"])
    wqkv = block["attn"]["qkv"]["kernel"]  # [D, 3, H, Dh]
    q, k, v = (jnp.einsum("bld,dhk->blhk", h, wqkv[:, j]) for j in range(3))
    attended = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=causal)
    x = x + jnp.einsum("blhk,hkd->bld", attended, block["attn"]["out"]["kernel"])
    h = rms(x, block["mlp_norm"]["scale"])
    mlp = block["mlp"]
    x = x + (nn.silu(h @ mlp["gate"]["kernel"]) * (h @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
  return rms(x, p["final_norm"]["scale"]) @ p["logits"]["kernel"]


@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_plain_reference(causal):
  # Random (not init-sized) params, so every kernel's role shows in the logits.
  model = _model(causal=causal)
  tokens = _tokens()
  params = _perturb(init(model, jax.random.key(0), tokens), scale=0.3)
  positions = jnp.asarray([[3, 1, 4, 1, 5, 7, 2, 6], list(range(8))], jnp.int32)
  expected = _reference_forward(params, tokens, positions, causal)
  out = model.apply(params, tokens, None, None, positions)
  assert float(jnp.std(expected)) > 0.1  # Not a near-constant function.
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-4, atol=1e-4)
  # The gate and up kernels have distinct roles: swapping them changes the logits.
  swapped = jax.tree.map(lambda a: a, params)
  mlp = swapped["params"]["block_0"]["mlp"]
  mlp["gate"], mlp["up"] = mlp["up"], mlp["gate"]
  assert float(jnp.abs(model.apply(swapped, tokens, None, None, positions) - out).max()) > 1e-2


@pytest.mark.parametrize(
  "kwargs, alpha, match",
  [
    (dict(time_conditioning="film"), None, "time_conditioning='film' is unknown"),
    (dict(model_dim=30, num_heads=4), None, "model_dim=30 / num_heads=4 must be an even integer"),
    (dict(model_dim=12, num_heads=4), None, "model_dim=12 / num_heads=4 must be an even integer"),
    (dict(time_conditioning="adaln"), None, "requires alpha"),
    (dict(time_conditioning="adaln"), jnp.zeros((B, 1)), "alpha must have shape"),
  ],
)
def test_bad_arguments(kwargs, alpha, match):
  with pytest.raises(ValueError, match=match):
    _model(**kwargs).init(jax.random.key(0), _tokens(), alpha)


def test_jit_matches_eager():
  model = _model(time_conditioning="adaln")
  tokens, alpha = _tokens(), _alpha(0.7)
  params = _perturb(init(model, jax.random.key(1), tokens, alpha))
  eager = model.apply(params, tokens, alpha)
  jitted = jax.jit(model.apply)(params, tokens, alpha)
  np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-5)


def test_depth_scaled_init():
  model = _model(num_layers=4, model_dim=64, mlp_dim=256)
  p = init(model, jax.random.key(0), _tokens())["params"]
  out_std = 0.02 / math.sqrt(2 * 4)
  blk = p["block_0"]
  np.testing.assert_allclose(jnp.std(blk["mlp"]["down"]["kernel"]), out_std, rtol=0.1)
  np.testing.assert_allclose(jnp.std(blk["attn"]["out"]["kernel"]), out_std, rtol=0.15)
  np.testing.assert_allclose(jnp.std(blk["mlp"]["up"]["kernel"]), 0.02, rtol=0.1)
  np.testing.assert_allclose(jnp.std(blk["attn"]["qkv"]["kernel"]), 0.02, rtol=0.1)


def test_count_params_and_flops():
  D, F, N = 32, 64, 2
  params = init(_model(), jax.random.key(0), _tokens())
  matmul = N * (4 * D * D + 3 * D * F) + D * V
  norms = N * 2 * D + D
  assert count_params(params) == matmul + norms + (V + 1) * D
  assert flops_per_token(N, D, F, L, V) == 2 * matmul + N * 4 * L * D


# Two packed documents (lengths 5 and 2) and one padding position.
_SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 0]] * B, np.int32)
_POSITIONS = np.array([[0, 1, 2, 3, 4, 0, 1, 0]] * B, np.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("time_conditioning", ["none", "adaln"])
def test_packed_documents_match_running_each_alone(causal, time_conditioning):
  model = _model(causal=causal, time_conditioning=time_conditioning)
  tokens, alpha = _tokens(), (_alpha() if time_conditioning == "adaln" else None)
  params = _perturb(init(model, jax.random.key(1), tokens, alpha))
  packed = model.apply(params, tokens, alpha, _SEGMENTS, _POSITIONS)
  assert bool(jnp.all(jnp.isfinite(packed)))  # Padding rows too: no NaN.
  doc1 = model.apply(params, tokens[:, :5], alpha)
  doc2 = model.apply(params, tokens[:, 5:7], alpha)
  np.testing.assert_allclose(packed[:, :5], doc1, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[:, 5:7], doc2, atol=1e-5, rtol=1e-5)


def test_segments_block_cross_document_attention():
  model = _model()
  tokens = _tokens()
  params = _perturb(init(model, jax.random.key(1), tokens))
  apply = lambda t: model.apply(params, t, None, _SEGMENTS, _POSITIONS)
  # Changing document 2 and the padding leaves document 1 exactly unchanged ...
  changed = tokens.at[:, 5:].set((tokens[:, 5:] + 1) % (V + 1))
  np.testing.assert_array_equal(np.asarray(apply(tokens)[:, :5]), np.asarray(apply(changed)[:, :5]))
  # ... and the gradient of document 2's logits w.r.t. document 1's embeddings is 0.
  embed = params["params"]["embed"]["embedding"]

  def doc2_logits(table):
    p = {"params": {**params["params"], "embed": {"embedding": table}}}
    return model.apply(p, tokens, None, _SEGMENTS, _POSITIONS)[:, 5:7].sum()

  grad = jax.grad(doc2_logits)(embed)
  doc1_ids = np.setdiff1d(np.asarray(tokens[:, :5]), np.asarray(tokens[:, 5:]))
  assert doc1_ids.size and float(jnp.abs(grad[doc1_ids]).max()) == 0.0
  # Without segment ids the same change does reach document 1 (the test is not vacuous).
  plain = lambda t: model.apply(params, t)
  assert float(jnp.abs(plain(tokens)[:, :5] - plain(changed)[:, :5]).max()) > 1e-4


def test_one_segment_and_default_positions_match_default():
  model = _model(time_conditioning="adaln")
  tokens, alpha = _tokens(), _alpha()
  params = _perturb(init(model, jax.random.key(1), tokens, alpha))
  default = model.apply(params, tokens, alpha)
  ones = jnp.ones_like(tokens)
  arange = jnp.broadcast_to(jnp.arange(L), tokens.shape)
  np.testing.assert_array_equal(
    np.asarray(model.apply(params, tokens, alpha, None, arange)), np.asarray(default)
  )
  np.testing.assert_allclose(model.apply(params, tokens, alpha, ones), default, atol=1e-6)


def test_segment_mask():
  mask = np.asarray(segment_attention_mask(jnp.asarray(_SEGMENTS[:1])))[0, 0]
  assert mask.shape == (L, L)
  assert mask[:5, :5].all() and mask[5:7, 5:7].all()
  assert not mask[:5, 5:].any() and not mask[5:, :5].any() and not mask[:7, 7].any()
  assert mask[7, 7] and not mask[7, :7].any()  # Padding attends to itself only.


def test_bad_segment_shape():
  with pytest.raises(ValueError, match="segment_ids must have"):
    init(_model(), jax.random.key(0), _tokens(), None, jnp.ones((B, L + 1), jnp.int32))


def _stack_blocks(params, num_layers):
  """Unrolled params (block_0, block_1, ...) in the scanned layout (blocks/block, layers first)."""
  params = dict(params)
  blocks = [params.pop(f"block_{i}") for i in range(num_layers)]
  params["blocks"] = {"block": jax.tree.map(lambda *layers: jnp.stack(layers), *blocks)}
  return params


@pytest.mark.parametrize(
  "remat, scan_layers, time_conditioning",
  [("none", True, "adaln"), ("full", False, "none"), ("save_dots", True, "none")],
)
def test_remat_and_scan_equal_the_plain_model(remat, scan_layers, time_conditioning):
  tokens, alpha = _tokens(), _alpha()
  plain = _model(time_conditioning=time_conditioning)
  params = _perturb(jax.jit(lambda: init(plain, jax.random.key(1), tokens, alpha))())["params"]
  variant = _model(time_conditioning=time_conditioning, remat=remat, scan_layers=scan_layers)
  variant_params = _stack_blocks(params, 2) if scan_layers else params
  variant_shapes = jax.eval_shape(lambda: init(variant, jax.random.key(1), tokens, alpha))["params"]
  assert jax.tree.map(lambda x: x.shape, variant_shapes) == jax.tree.map(
    lambda x: x.shape, variant_params
  )

  def loss(model, p):
    return jnp.sum(model.apply({"params": p}, tokens, alpha) ** 2)

  value, grads = jax.jit(jax.value_and_grad(lambda p: loss(plain, p)))(params)
  variant_value, variant_grads = jax.jit(jax.value_and_grad(lambda p: loss(variant, p)))(
    variant_params
  )
  np.testing.assert_allclose(variant_value, value, rtol=1e-5)
  expected = _stack_blocks(grads, 2) if scan_layers else grads
  # A different op order: float32 rounding, relative to each leaf's scale.
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max()),
    variant_grads,
    expected,
  )


@pytest.mark.parametrize("scan_layers", [False, True])
def test_save_dots_recomputes_no_weight_matmul(scan_layers):
  """remat="save_dots" keeps the weight matmuls' outputs (project's by name): the gradient costs
  the FLOPs of no remat, and full remat more. (XLA counts a scanned body once: the same ratio.)"""
  tokens = _tokens()

  def grad_flops(remat):
    model = _model(num_layers=2, model_dim=64, mlp_dim=256, remat=remat, scan_layers=scan_layers)
    params = init(model, jax.random.key(1), tokens)["params"]
    grad = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, tokens) ** 2))
    return costs.compiled_flops(jax.jit(grad).lower(params).compile())

  none, save_dots, full = grad_flops("none"), grad_flops("save_dots"), grad_flops("full")
  assert full > 1.2 * none
  assert save_dots < 1.02 * none, (save_dots, none)


def test_scanned_params_carry_a_layers_axis():
  model = _model(scan_layers=True)
  boxed = model.init(jax.random.key(0), _tokens())["params"]
  kernel = boxed["blocks"]["block"]["attn"]["qkv"]["kernel"]
  assert kernel.names == ("layers", "embed", "qkv", "heads", "head_dim")
  assert kernel.value.shape == (2, 32, 3, 4, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_splash_attention_matches_xla_attention(causal):
  # The TPU kernel through its interpreter (any platform): packed documents and padding.
  batch, length, heads, head_dim = 2, 128, 2, 64
  q, k, v = jax.random.normal(jax.random.key(0), (3, batch, length, heads, head_dim), jnp.float32)
  segments = jnp.concatenate(
    [jnp.full((batch, 50), 1), jnp.full((batch, 60), 2), jnp.zeros((batch, 18))], axis=1
  ).astype(jnp.int32)
  expected = jax.nn.dot_product_attention(
    q, k, v, mask=segment_attention_mask(segments), is_causal=causal
  )
  out = splash_attention(q, k, v, segments, causal, interpret=True)
  real = np.asarray(segments != 0)
  np.testing.assert_allclose(
    np.asarray(out)[real], np.asarray(expected)[real], rtol=2e-5, atol=2e-5
  )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_softmax_attention_equals_jax_dot_product_attention(causal, packed):
  # The "xla" path is a plain einsum softmax (faster on CPU): the same math as jax.nn's.
  q, k, v = jax.random.normal(jax.random.key(1), (3, 2, 24, 3, 8), jnp.float32)
  segments = jnp.asarray([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24], jnp.int32)
  mask = segment_attention_mask(segments) if packed else None
  expected = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
  out = softmax_attention(q, k, v, mask, causal)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)
  bf16 = softmax_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, causal)
  assert bf16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(expected), atol=0.05)


def test_splash_needs_a_length_divisible_by_128():
  with pytest.raises(ValueError, match="divisible by 128"):
    splash_block_size(100)
  assert splash_block_size(1024) == 512 and splash_block_size(384) == 128


def test_md4_model_choices():
  """The ablation options: MD4's LayerNorm (no params), sigmoid gate, narrow embedding, zero output."""
  tokens = _tokens()
  base = _model()
  base_params = init(base, jax.random.key(0), tokens)["params"]
  md4 = _model(norm="layer", mlp="sigmoid_glu", embed_dim=16, output_init="zeros")
  params = init(md4, jax.random.key(0), tokens)["params"]
  assert params["embed"]["embedding"].shape == (V + 1, 16)
  assert params["embed_proj"]["kernel"].shape == (16, 32)
  assert "final_norm" not in params and "attn_norm" not in params["block_0"]  # LayerNorm, no scale.
  np.testing.assert_array_equal(params["logits"]["kernel"], 0.0)
  np.testing.assert_array_equal(md4.apply({"params": params}, tokens), 0.0)  # Uniform at init.
  # Each option changes the function: the gate alone, on the base model's params.
  sigmoid = _model(mlp="sigmoid_glu")
  assert not np.allclose(
    sigmoid.apply({"params": base_params}, tokens), base.apply({"params": base_params}, tokens)
  )
  for bad in (
    dict(norm="batch"),
    dict(mlp="relu"),
    dict(output_init="ones"),
    dict(weight_init="xavier"),
    dict(time_features="vdm"),
    dict(adaln_activation="gelu"),
  ):
    with pytest.raises(ValueError, match="unknown"):
      init(_model(**bad), jax.random.key(0), tokens)


@pytest.mark.parametrize("weight_init", ["fan_in", "fan_in_mlp_depth"])
def test_fan_in_inits(weight_init):
  """Truncated normal of variance scale/fan_in for every matrix (the MLP's at 2/N under
  fan_in_mlp_depth), N(0, 1/width) for the embedding, zeros for adaLN and biases."""
  N, D, F, E = 4, 64, 256, 32
  model = _model(
    num_layers=N,
    model_dim=D,
    mlp_dim=F,
    embed_dim=E,
    weight_init=weight_init,
    time_conditioning="adaln",
    biases=True,
    time_dim=16,
    time_hidden_dim=48,
  )
  p = init(model, jax.random.key(0), _tokens(), _alpha())["params"]
  mlp_scale = 2 / N if weight_init == "fan_in_mlp_depth" else 1.0
  blk = p["block_0"]
  expected = {
    "qkv": (blk["attn"]["qkv"]["kernel"], 1 / D),
    "out": (blk["attn"]["out"]["kernel"], 1 / D),
    "gate": (blk["mlp"]["gate"]["kernel"], mlp_scale / D),
    "up": (blk["mlp"]["up"]["kernel"], mlp_scale / D),
    "down": (blk["mlp"]["down"]["kernel"], mlp_scale / F),
    "embed": (p["embed"]["embedding"], 1 / E),
    "embed_proj": (p["embed_proj"]["kernel"], 1 / E),
    "time_in": (p["time_in"]["kernel"], 1 / 16),
    "time_out": (p["time_out"]["kernel"], 1 / 48),
    "logits": (p["logits"]["kernel"], 1 / D),
  }
  for name, (kernel, variance) in expected.items():
    np.testing.assert_allclose(float(jnp.std(kernel)), math.sqrt(variance), rtol=0.15, err_msg=name)
  # Truncated at two standard deviations (of the untruncated normal), except the embedding's.
  bound = 2 * math.sqrt(1 / D) / 0.87962566103423978
  assert float(jnp.abs(blk["attn"]["qkv"]["kernel"]).max()) <= bound
  assert float(jnp.abs(p["embed"]["embedding"]).max()) > 2 / 0.87962566103423978 / math.sqrt(E)
  for zero in (
    blk["adaln"]["kernel"],
    blk["adaln"]["bias"],
    p["final_adaln"]["bias"],
    p["embed_proj"]["bias"],
    p["time_in"]["bias"],
    p["time_out"]["bias"],
  ):
    np.testing.assert_array_equal(zero, 0.0)


def test_time_path_options():
  """time_dim, time_hidden_dim, biases and the adaLN activation shape the time path; every
  option changes the function (checked on random params)."""
  tokens, alpha = _tokens(), _alpha(0.3)
  md4 = dict(
    time_conditioning="adaln",
    time_features="ddpm",
    time_dim=8,
    time_hidden_dim=32,
    biases=True,
    adaln_activation="sigmoid",
    embed_dim=8,
  )
  model = _model(**md4)
  params = init(model, jax.random.key(0), tokens, alpha)
  p = params["params"]
  assert p["time_in"]["kernel"].shape == (8, 32) and p["time_in"]["bias"].shape == (32,)
  assert p["time_out"]["kernel"].shape == (32, 8) and p["time_out"]["bias"].shape == (8,)
  assert p["block_0"]["adaln"]["kernel"].shape == (8, 6 * 32)
  assert p["block_0"]["adaln"]["bias"].shape == (6 * 32,)
  assert p["final_adaln"]["kernel"].shape == (8, 2 * 32) and p["embed_proj"]["bias"].shape == (32,)
  assert "bias" not in p["logits"] and "bias" not in p["block_0"]["mlp"]["gate"]
  params = _perturb(params, scale=0.3)
  logits = model.apply(params, tokens, alpha)
  for change in (dict(time_features="dit"), dict(adaln_activation="silu"), dict(norm_eps=1e-2)):
    other = _model(**{**md4, **change}).apply(params, tokens, alpha)
    assert float(jnp.abs(other - logits).max()) > 1e-4, change
  # Without biases the bias params are not read: the tree lacks them.
  nobias = init(_model(**{**md4, "biases": False}), jax.random.key(0), tokens, alpha)["params"]
  assert "bias" not in nobias["time_in"] and "bias" not in nobias["block_0"]["adaln"]


def test_ddpm_time_features():
  """[sin, cos] of 1000·t at frequencies 10000^(−i/(half − 1)), computed as float64 here."""
  t = np.asarray([0.0, 0.1234, 0.5, 1.0], np.float32)
  got = np.asarray(timestep_features(jnp.asarray(t), 10, style="ddpm"))
  freqs = 10000.0 ** (-np.arange(5) / 4.0)
  args = 1000.0 * t.astype(np.float64)[:, None] * freqs
  np.testing.assert_allclose(got, np.concatenate([np.sin(args), np.cos(args)], axis=1), atol=2e-4)
  assert got.shape == (4, 10) and got[0, 5:].tolist() == [1.0] * 5
  dit = np.asarray(timestep_features(jnp.asarray(t), 10, style="dit"))
  np.testing.assert_allclose(
    dit[:, :5], np.cos(1000.0 * t[:, None] * 10000.0 ** (-np.arange(5) / 5)), atol=2e-4
  )
  with pytest.raises(ValueError, match="time width >= 4"):
    _model(time_conditioning="adaln", time_features="ddpm", time_dim=2).init(
      jax.random.key(0), _tokens(), _alpha()
    )
