"""Dream's shift (model.shift_logits): position i's logits are the unshifted network's at i − 1
(position 0 keeps its own), computed by shifting the final hidden state [B, L, D] before the
vocabulary projection, never by copying the logits [B, L, V] (V = 152064 for Dream)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.model.transformer import Transformer

V, D, B, L = 11, 32, 2, 8


def _model(**kw):
  return Transformer(
    vocab_size=V, num_layers=2, model_dim=D, num_heads=4, mlp_dim=64, time_conditioning="none", **kw
  )


def _inputs():
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, V + 1, dtype=jnp.int32)
  return tokens, jnp.full((B,), 0.5, jnp.float32)


@pytest.mark.parametrize("tie_embeddings", [False, True])
@pytest.mark.parametrize("checkpoint_mask_id", [-1, 3])
def test_shifted_logits_are_the_unshifted_ones_one_position_later(
  tie_embeddings, checkpoint_mask_id
):
  kw = dict(tie_embeddings=tie_embeddings, checkpoint_mask_id=checkpoint_mask_id)
  plain, shifted = _model(**kw), _model(shift_logits=True, **kw)
  tokens, alpha = _inputs()
  params = nn.meta.unbox(plain.init(jax.random.key(1), tokens, alpha))
  expected = np.asarray(plain.apply(params, tokens, alpha))
  expected = np.concatenate([expected[:, :1], expected[:, :-1]], axis=1)
  got = np.asarray(shifted.apply(params, tokens, alpha))
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
  if checkpoint_mask_id >= 0:  # The mask's column is -inf at every position, position 0 too.
    assert np.all(got[..., checkpoint_mask_id] == -np.inf)


def _concatenations(jaxpr):
  """The output shapes of every concatenate in jaxpr and the jaxprs inside it."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "concatenate":
      shapes.append(tuple(eqn.outvars[0].aval.shape))
    for value in eqn.params.values():
      for inner in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(inner, jax.extend.core.ClosedJaxpr):
          shapes += _concatenations(inner.jaxpr)
        elif isinstance(inner, jax.extend.core.Jaxpr):
          shapes += _concatenations(inner)
  return shapes


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_the_shift_copies_the_hidden_state_not_the_logits(tie_embeddings):
  plain, shifted = (
    _model(tie_embeddings=tie_embeddings),
    _model(shift_logits=True, tie_embeddings=tie_embeddings),
  )
  tokens, alpha = _inputs()
  params = nn.meta.unbox(plain.init(jax.random.key(1), tokens, alpha))
  count = lambda model: _concatenations(
    jax.make_jaxpr(lambda p: model.apply(p, tokens, alpha))(params).jaxpr
  )
  added = count(shifted)
  for shape in count(plain):  # The shift's own concatenation: what the shifted model adds.
    added.remove(shape)
  assert added == [(B, L, D)]
