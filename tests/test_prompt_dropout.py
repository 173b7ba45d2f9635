"""training.prompt_dropout (classifier-free guidance's training): a dropped row's prompt is hidden
from the network, never scored, and p = 0 leaves the loss unchanged bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.training import objective
from md4jax.training import state as state_lib

ROWS, PROMPT = 64, 5


@pytest.fixture(scope="module")
def setup():
  config = config_lib.load_config("tiny")
  model = state_lib.build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (ROWS, config.data.seq_len), 0, 8)
  segments = jnp.ones_like(tokens).at[:, -3:].set(0)  # Three padding positions per row.
  batch = {
    "tokens": tokens,
    "segment_ids": segments,
    "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
    "editable": (jnp.arange(tokens.shape[1]) >= PROMPT) & (segments != 0),
  }
  params = model.init(jax.random.PRNGKey(1), tokens)["params"]
  return config, model, params, batch


def _loss(model, params, batch, p):
  config = config_lib.load_config("tiny")
  config.training.prompt_dropout = p
  nats, _ = objective.training_loss(
    params,
    batch,
    jax.random.PRNGKey(2),
    model=model,
    config=config,
    row_index=jnp.arange(ROWS),
    num_rows=ROWS,
  )
  return np.asarray(nats)


def test_dropped_prompts_are_prompt_positions_of_about_p_of_the_rows(setup):
  _, _, _, batch = setup
  hidden = np.asarray(
    objective.dropped_prompts(batch, jax.random.PRNGKey(3), 0.5, jnp.arange(ROWS))
  )
  rows = hidden.any(axis=1)
  assert 0.25 < rows.mean() < 0.75
  np.testing.assert_array_equal(
    hidden[rows], np.tile(np.arange(hidden.shape[1]) < PROMPT, (rows.sum(), 1))
  )
  assert not hidden[~rows].any()
  none = objective.dropped_prompts(batch, jax.random.PRNGKey(3), 0.0, jnp.arange(ROWS))
  assert not np.asarray(none).any()


def test_a_dropped_prompt_changes_what_the_network_reads_not_what_is_scored(setup):
  config, model, params, batch = setup
  dropped = _loss(model, params, batch, 0.5)
  # The step key is split for the dropout: the loss's own draws come from the first half. The
  # same draws with every prompt shown give the rows whose prompt was kept, bit for bit.
  key, dropout_key = jax.random.split(jax.random.PRNGKey(2))
  hidden = np.asarray(objective.dropped_prompts(batch, dropout_key, 0.5, jnp.arange(ROWS)))
  shown = np.asarray(
    objective.sequence_nats(
      params,
      batch,
      key,
      model=model,
      config=config,
      estimator=config.training.estimator,
      t_sampling="stratified",
    )
  )
  rows = hidden.any(axis=1)
  np.testing.assert_array_equal(shown[~rows], dropped[~rows])
  scored = rows & (shown > 0)  # A row with nothing masked scores 0 either way.
  assert scored.sum() > 5 and np.all(shown[scored] != dropped[scored])
  # p = 0 draws no dropout key: the loss is the plain one.
  np.testing.assert_array_equal(
    _loss(model, params, batch, 0.0),
    np.asarray(
      objective.sequence_nats(
        params,
        batch,
        jax.random.PRNGKey(2),
        model=model,
        config=config,
        estimator=config.training.estimator,
        t_sampling="stratified",
      )
    ),
  )


@pytest.mark.parametrize(
  "value, model_type, match",
  [
    (1.0, "mdm", r"training.prompt_dropout must be in \[0, 1\)"),
    (0.1, "ar", r"model.type is 'ar'"),
  ],
)
def test_prompt_dropout_is_validated(value, model_type, match):
  config = config_lib.load_config("tiny")
  config.training.prompt_dropout, config.model.type = value, model_type
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config, num_devices=1)
