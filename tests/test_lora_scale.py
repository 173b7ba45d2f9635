"""LoRA's scale by hand: a projection computes x · W + (lora_alpha / r) · (x · A) · B, checked on
explicit numbers (tests/test_lora.py checks merge against the forward pass, both through
lora.scale); every layer defaults lora_alpha as the network and config do, and refuses alpha <= 0
with adapters on."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.model import lora
from md4jax.model.attention import Attention
from md4jax.model.block import Block
from md4jax.model.layers import Projection, SwiGLU
from md4jax.model.transformer import Transformer

X = jnp.asarray([[1.0, 2.0]])  # [1, in = 2]
W = jnp.asarray([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]])  # [in, out = 3]: x · W = [1, 2, 0]
A = jnp.asarray([[1.0, 2.0], [0.0, 1.0]])  # [in, r = 2]: x · A = [1, 4]
B = jnp.asarray([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # [r, out]: (x · A) · B = [1, 0, 4]


def _projection(**lora_args):
  return Projection(
    (2, 3), 1, ("embed", "mlp"), nn.initializers.zeros, jnp.float32, lora_rank=2, **lora_args
  )


def _apply(projection):
  params = {"kernel": W, lora.LORA_A: A, lora.LORA_B: B}
  return np.asarray(projection.apply({"params": params}, X))


def test_a_projection_adds_alpha_over_r_times_x_a_b():
  # alpha 8, r 2: [1, 2, 0] + 4 · [1, 0, 4].
  np.testing.assert_array_equal(_apply(_projection(lora_alpha=8.0)), [[5.0, 2.0, 16.0]])
  # alpha 1, r 2: [1, 2, 0] + 0.5 · [1, 0, 4].
  np.testing.assert_array_equal(_apply(_projection(lora_alpha=1.0)), [[1.5, 2.0, 2.0]])


def test_a_projections_default_alpha_is_the_networks_and_the_configs():
  # The default 16 at r 2: [1, 2, 0] + 8 · [1, 0, 4], not the base projection alone.
  np.testing.assert_array_equal(_apply(_projection()), [[9.0, 2.0, 32.0]])
  defaults = {
    layer.__name__: {f.name: f.default for f in dataclasses.fields(layer)}["lora_alpha"]
    for layer in (Projection, SwiGLU, Attention, Block, Transformer)
  }
  assert set(defaults.values()) == {lora.DEFAULT_ALPHA}, defaults
  assert config_lib.base_config().model.lora_alpha == lora.DEFAULT_ALPHA


@pytest.mark.parametrize("alpha", [0.0, -8.0])
def test_adapters_with_a_non_positive_alpha_are_refused(alpha):
  with pytest.raises(ValueError, match="lora_alpha > 0"):
    _apply(_projection(lora_alpha=alpha))
  mlp = SwiGLU(4, "fan_in", 1, jnp.float32, lora_rank=2, lora_alpha=alpha)
  with pytest.raises(ValueError, match="lora_alpha > 0"):
    mlp.init(jax.random.key(0), jnp.ones((1, 3, 2)))
