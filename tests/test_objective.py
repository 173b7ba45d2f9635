"""The per-sequence objective: AR inputs and exact NLL, and rows scored independently of the split."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from md4jax import config_lib
from md4jax import data
from md4jax import objective
from md4jax import sharding
from md4jax import state as state_lib


def test_ar_inputs_shift_right_with_bos():
  tokens = jnp.array([[3, 1, 4, 1]])
  np.testing.assert_array_equal(objective.ar_inputs(tokens, bos_id=8), [[8, 3, 1, 4]])


def _untrained(name):
  config = config_lib.load_config(name)
  model = state_lib.build_model(config)
  params = state_lib.init_state(config, model, state_lib.make_optimizer(config),
                                sharding.make_mesh(config, jax.devices()[:1])).params
  batch = data.make_source(config).batch(0)
  return config, model, params, batch


def test_ar_nll_is_the_causal_cross_entropy_of_each_row():
  config, model, params, batch = _untrained("tiny_ar")
  nats = objective.sequence_nats(params, batch, None, model=model, config=config,
                                 estimator="exact", t_sampling="uniform")
  logits = model.apply({"params": params}, objective.ar_inputs(batch["tokens"], config.data.vocab_size))
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).sum(-1)
  np.testing.assert_allclose(nats, expected, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["standard", "mask_count"])
def test_a_rows_draw_depends_on_its_global_index_only(estimator):
  # Scoring rows 8..15 of a 16-row batch on their own, told their global indices, gives
  # exactly their values from the whole batch: the draws do not depend on the split.
  config, model, params, batch = _untrained("tiny")
  key = jax.random.PRNGKey(3)
  score = lambda rows, **kw: objective.sequence_nats(params, rows, key, model=model, config=config,
                                                      estimator=estimator, t_sampling="stratified", **kw)
  whole = score(batch)
  half = score(jax.tree.map(lambda x: x[8:], batch), row_index=jnp.arange(8, 16), num_rows=16)
  np.testing.assert_allclose(half, whole[8:], rtol=1e-6)
  assert not np.allclose(score(jax.tree.map(lambda x: x[8:], batch)), whole[8:])
  assert math.isfinite(float(whole.sum()))
