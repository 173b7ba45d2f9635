"""The per-sequence objective: AR inputs and exact NLL, and rows scored independently of the split."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.runtime import sharding
from md4jax.training import objective
from md4jax.training import state as state_lib


def test_ar_inputs_shift_right_with_bos():
  tokens = jnp.array([[3, 1, 4, 1]])
  np.testing.assert_array_equal(objective.ar_inputs(tokens, bos_id=8), [[8, 3, 1, 4]])


def _untrained(name):
  config = config_lib.load_config(name)
  model = state_lib.build_model(config)
  params = state_lib.init_state(
    config, model, state_lib.make_optimizer(config), sharding.make_mesh(config, jax.devices()[:1])
  ).params
  batch = sources.make_source(config).batch(0)
  return config, model, params, batch


def test_ar_nll_is_the_causal_cross_entropy_of_each_row():
  config, model, params, batch = _untrained("tiny_ar")
  nats = objective.sequence_nats(
    params, batch, None, model=model, config=config, estimator="exact", t_sampling="uniform"
  )
  logits = model.apply(
    {"params": params}, objective.ar_inputs(batch["tokens"], config.data.vocab_size)
  )
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).sum(-1)
  np.testing.assert_allclose(nats, expected, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["standard", "mask_count"])
def test_a_rows_draw_depends_on_its_global_index_only(estimator):
  # Scoring rows 8..15 of a 16-row batch on their own, told their global indices, gives
  # exactly their values from the whole batch: the draws do not depend on the split.
  config, model, params, batch = _untrained("tiny")
  key = jax.random.PRNGKey(3)
  score = lambda rows, **kw: objective.sequence_nats(
    params,
    rows,
    key,
    model=model,
    config=config,
    estimator=estimator,
    t_sampling="stratified",
    **kw,
  )
  whole = score(batch)
  half = score(jax.tree.map(lambda x: x[8:], batch), row_index=jnp.arange(8, 16), num_rows=16)
  np.testing.assert_allclose(half, whole[8:], rtol=1e-6)
  assert not np.allclose(score(jax.tree.map(lambda x: x[8:], batch)), whole[8:])
  assert math.isfinite(float(whole.sum()))


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_rows_without_segment_ids_score_as_one_segment_at_positions_0_to_L(name):
  # dense_batch leaves segment_ids and positions out (the model builds no attention mask): the
  # same rows given as one segment each at positions 0..L-1 score the same, draw for draw.
  config, model, params, batch = _untrained(name)
  assert batch["segment_ids"] is None and batch["positions"] is None
  shape = batch["tokens"].shape
  explicit = dict(
    batch,
    segment_ids=np.ones(shape, np.int32),
    positions=np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape),
  )
  score = lambda rows: objective.sequence_nats(
    params,
    rows,
    jax.random.PRNGKey(5),
    model=model,
    config=config,
    estimator="standard",
    t_sampling="stratified",
  )
  np.testing.assert_allclose(score(batch), score(explicit), rtol=1e-6)
  # Segment ids do change the scores where they split a row: the comparison can fail.
  halves = np.where(np.arange(shape[1]) < shape[1] // 2, 1, 2).astype(np.int32)
  split = dict(explicit, segment_ids=np.broadcast_to(halves, shape))
  assert not np.allclose(score(split), score(batch), rtol=1e-6)


def test_a_network_conditioned_on_t_gets_t():
  """model.time_input = "t" (MD4's): the samplers' denoiser turns their α into t by the
  schedule's inverse; the training loss calls the network with the t it drew."""
  config = config_lib.load_config("tiny")
  config.model.time_conditioning, config.model.time_input = "adaln", "t"
  config.model.time_dim, config.model.time_hidden_dim = 16, 64  # Narrower than the model.
  config.diffusion.schedule = "md4linear"
  model = state_lib.build_model(config)
  params = jax.tree.map(
    lambda p: p + 0.1,
    state_lib.init_state(  # adaLN off zero: t matters.
      config, model, state_lib.make_optimizer(config), sharding.make_mesh(config, jax.devices()[:1])
    ).params,
  )
  z = jnp.full((2, config.data.seq_len), config.data.vocab_size, jnp.int32)
  alpha = jnp.asarray([0.9, 0.2], jnp.float32)
  schedule = objective.schedule_of(params, config)
  got = objective.sampling_denoiser(model, params, config)(z, alpha)
  np.testing.assert_allclose(
    got, model.apply({"params": params}, z, schedule.time_of(alpha)), rtol=1e-6
  )
  assert np.abs(got - model.apply({"params": params}, z, alpha)).max() > 1e-3
  config.model.time_input = "alpha"
  np.testing.assert_array_equal(
    objective.sampling_denoiser(model, params, config)(z, alpha),
    model.apply({"params": params}, z, alpha),
  )


def test_the_samplers_denoiser_repeats_a_rows_layout_for_guidance():
  """sampling_denoiser with segment_ids and positions of B rows serves a call on 2B rows (the
  guided doubled batch): each half reads the same layout, as each row alone would."""
  config = config_lib.load_config("tiny")
  model = state_lib.build_model(config)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, config.data.seq_len), jnp.int32))[
    "params"
  ]
  length = config.data.seq_len
  segments = jnp.asarray([[1] * (length - 3) + [0] * 3, [1] * length], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), (2, length))
  z = jax.random.randint(jax.random.PRNGKey(1), (4, length), 0, config.data.vocab_size + 1)
  got = objective.sampling_denoiser(model, params, config, segments, positions)(z, jnp.ones(4))
  for half in (0, 2):  # Equal up to float reassociation across batch sizes.
    np.testing.assert_allclose(
      got[half : half + 2],
      objective.sampling_denoiser(model, params, config, segments, positions)(
        z[half : half + 2], jnp.ones(2)
      ),
      rtol=1e-5,
      atol=1e-6,
    )
  padded_alone = model.apply({"params": params}, z[:1], None, segments[:1], positions[:1])
  np.testing.assert_allclose(got[:1], padded_alone, rtol=1e-5, atol=1e-6)
  unpadded = model.apply({"params": params}, z[:1], None, segments[1:], positions[1:])
  assert np.abs(got[:1] - unpadded).max() > 1e-3  # The padding layout mattered.
