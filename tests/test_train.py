"""The train step: golden loss; any mesh, and gradient accumulation, give the 1-device big-batch step."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.runtime import sharding
from md4jax.training import state as state_lib
from md4jax.training import train

# Loss of the first step of configs/tiny.py on one device. It changes only when the
# model, the objective, the data or the initialization change on purpose: update it then.
# (Changed when each row's draws came to depend on its global row index only, and when the
# Markov training data came to be drawn by inverse CDF.)
GOLDEN_TINY_FIRST_LOSS = 2.0168750286102295


def load_config(name, **mesh):
  config = config_lib.load_config(name)
  for axis, size in mesh.items():
    config.mesh[axis] = size
  config.lock()
  return config


def first_steps(config, devices, num_steps=1):
  """Runs num_steps train steps on config.mesh over `devices`; returns (state, [metrics])."""
  mesh = sharding.make_mesh(config, devices)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  step_fn = train.make_train_step(config, model, optimizer, mesh, state)
  iterator = sources.make_source(config).train_iterator()
  history = []
  for _ in range(num_steps):
    state, metrics = step_fn(state, sharding.device_batch(next(iterator), mesh))
    history.append(jax.device_get(metrics))
  return state, history


def assert_same_run(run_a, run_b, rtol=1e-5):
  (state_a, metrics_a), (state_b, metrics_b) = run_a, run_b
  for m_a, m_b in zip(metrics_a, metrics_b):
    for name in m_a:
      np.testing.assert_allclose(m_b[name], m_a[name], rtol=rtol, err_msg=name)
  chex.assert_trees_all_close(
    jax.device_get(state_a), jax.device_get(state_b), rtol=rtol, atol=1e-7
  )


def test_golden_loss_after_one_step():
  _, [metrics] = first_steps(load_config("tiny"), jax.devices()[:1])
  np.testing.assert_allclose(
    metrics["loss"],
    GOLDEN_TINY_FIRST_LOSS,
    rtol=1e-5,
    err_msg="The first-step loss of configs/tiny.py changed. It changes only on purpose "
    "(model, objective, data or init); if so, update GOLDEN_TINY_FIRST_LOSS.",
  )
  np.testing.assert_allclose(
    metrics["nelbo_bits_per_token"], metrics["loss"] / math.log(2), rtol=1e-6
  )


@pytest.fixture(scope="module")
def one_device_run():
  return first_steps(load_config("tiny"), jax.devices()[:1], num_steps=2)


@pytest.mark.parametrize(
  "mesh", [dict(data=8), dict(data=1, fsdp=8), dict(data=2, fsdp=2, tensor=2)]
)
def test_every_mesh_matches_one_device(one_device_run, mesh):
  assert len(jax.devices()) == 8, "tests/conftest.py should provide 8 CPU devices"
  run = first_steps(load_config("tiny", **mesh), jax.devices(), num_steps=2)
  assert len(run[0].params["embed"]["embedding"].sharding.device_set) == 8
  assert_same_run(one_device_run, run)


def test_gradient_accumulation_equals_the_big_batch(one_device_run):
  config = load_config("tiny")
  config.unlock()
  config.training.grad_accum_steps = 4
  # On a (2, 2, 2) mesh: each device keeps its rows of every microbatch.
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  assert_same_run(one_device_run, first_steps(config, jax.devices(), num_steps=2))


@pytest.mark.parametrize("name", ["tiny", "tiny_ar"])
def test_loss_starts_near_uniform(name):
  # Small-init logits are near uniform, so the per-token loss starts near ln V. The
  # mask_count estimator makes the diffusion loss's one-batch estimate precise enough.
  config = load_config(name)
  config.unlock()
  config.training.estimator = "mask_count"
  _, [metrics] = first_steps(config, jax.devices()[:1])
  assert abs(metrics["loss"] - math.log(config.data.vocab_size)) < 0.05, metrics["loss"]


def test_ema_warm_up_forgets_the_random_init():
  """The init's share of the EMA after n updates is Π decay_k = 9! n! / (n + 9)! while the
  warm-up rate is below the configured decay; a fixed 0.999 would still hold 0.999^n."""
  decay = 0.999
  init_weight = 1.0
  for n in range(1, 1001):
    init_weight *= float(train.ema_decay_at(jnp.int32(n - 1), decay))
    if n in (10, 100, 1000):
      assert init_weight == pytest.approx(
        math.factorial(9) * math.factorial(n) / math.factorial(n + 9), rel=1e-3
      )
  assert init_weight < 1e-20 < 0.999**1000  # vs 37% without the warm-up.
  assert float(train.ema_decay_at(jnp.int32(10**6), decay)) == pytest.approx(decay)  # Capped.
  # In a train step: EMA_1 = 0.1 · init + 0.9 · params_1.
  config = load_config("tiny", data=1)
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  init = state_lib.init_state(config, model, optimizer, mesh)
  init_params = jax.device_get(init.params)
  state, _ = first_steps(config, jax.devices()[:1])
  expected = jax.tree.map(lambda i, p: 0.1 * i + 0.9 * p, init_params, jax.device_get(state.params))
  chex.assert_trees_all_close(jax.device_get(state.ema_params), expected, rtol=1e-5, atol=1e-7)


def test_md4_optimizer_options():
  """MD4's optimizer side: the EMA at its decay from step 0 (optimizer.ema_warmup = False), the
  gradient of the loss in bits (training.loss_units: nats / ln 2) and no clipping (grad_clip_norm 0)."""
  base = load_config("tiny", data=1)
  base.unlock()
  base.optimizer.ema_decay = 0.9
  md4 = base.copy_and_resolve_references()
  md4.optimizer.ema_warmup, md4.training.loss_units, md4.optimizer.grad_clip_norm = (
    False,
    "bits",
    0.0,
  )
  mesh = sharding.make_mesh(md4, jax.devices()[:1])
  model = state_lib.build_model(md4)
  init = jax.device_get(
    state_lib.init_state(md4, model, state_lib.make_optimizer(md4), mesh).params
  )
  (state, [metrics]), (_, [nats_metrics]) = (first_steps(c, jax.devices()[:1]) for c in (md4, base))
  expected = jax.tree.map(lambda i, p: 0.9 * i + 0.1 * p, init, jax.device_get(state.params))
  chex.assert_trees_all_close(jax.device_get(state.ema_params), expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
    metrics["grad_norm"], nats_metrics["grad_norm"] / math.log(2), rtol=1e-5
  )
  np.testing.assert_allclose(metrics["loss"], nats_metrics["loss"], rtol=1e-6)  # Reported in nats.
  assert train.ema_decay_at(jnp.int32(5), 0.9, warmup=False) == 0.9
  # No clipping: the optimizer is AdamW itself, on gradients of any norm (two steps, since one
  # Adam step does not see a gradient's scale).
  grads = [{"w": jnp.full((3,), 1e3)}, {"w": jnp.asarray([1.0, -2.0, 0.5])}]
  params = {"w": jnp.zeros((3,))}

  def updates(optimizer):
    opt_state, out = optimizer.init(params), []
    for g in grads:
      update, opt_state = optimizer.update(g, opt_state, params)
      out.append(update["w"])
    return np.asarray(out)

  adamw = state_lib.optax.adamw(
    state_lib.learning_rate_schedule(md4),
    b1=md4.optimizer.b1,
    b2=md4.optimizer.b2,
    weight_decay=0.0,
  )
  np.testing.assert_allclose(updates(state_lib.make_optimizer(md4)), updates(adamw), rtol=1e-6)
  assert not np.allclose(updates(state_lib.make_optimizer(base)), updates(adamw), rtol=1e-3)
