"""LoRA (model.lora_rank, md4jax.model.lora): the network at init is the base one, training moves
only the adapters and keeps Adam's moments for them alone, merged params are the adapted
network, and a LoRA run starts from another workdir, resumes and samples."""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.data import sources
from md4jax.model import lora
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective, train
from md4jax.training import state as state_lib

PROJECTIONS = {"attn": {"qkv", "out"}, "mlp": {"gate", "up", "down"}}


def _config(rank=4, **model):
  config = config_lib.load_config("tiny")
  config.model.num_layers = 2
  config.model.lora_rank = rank
  for name, value in model.items():
    config.model[name] = value
  return config


def _one_device():
  return Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)


def _tokens(config, rows=4, seed=0):
  return jax.random.randint(
    jax.random.PRNGKey(seed), (rows, config.data.seq_len), 0, config.data.vocab_size + 1
  )


def _logits(config, params, tokens):
  model = state_lib.build_model(config)
  return model.apply({"params": params}, tokens, jnp.full((tokens.shape[0],), 0.5))


def _block(params, config, i=0):
  """Block i's params (a scanned network's: its slice of the stacked ones)."""
  if config.model.scan_layers:
    return jax.tree.map(lambda a: a[i], params["blocks"]["block"])
  return params[f"block_{i}"]


@pytest.mark.parametrize(
  "model",
  [
    {},
    {"num_kv_heads": 1, "qkv_bias": True},  # q and kv projections, with biases.
    {"scan_layers": True, "time_conditioning": "adaln"},
  ],
)
def test_lora_network_at_init_is_the_base_network(model):
  config, base = _config(**model), _config(rank=0, **model)
  tokens = _tokens(config)
  init = lambda c: nn.meta.unbox(
    state_lib.build_model(c).init(jax.random.PRNGKey(1), tokens, jnp.ones((4,)))["params"]
  )
  adapted, base_params = init(config), init(base)
  # The base params keep their names and shapes, and (same seed) their values: under nn.scan
  # flax draws a body's params from counters its other params move, so there they differ.
  if not config.model.scan_layers:
    jax.tree.map(np.testing.assert_array_equal, lora.without_adapters(adapted), base_params)
  shapes = lambda tree: jax.tree.map(jnp.shape, tree)
  assert shapes(lora.without_adapters(adapted)) == shapes(base_params)
  # A base network's params with fresh adapters beside them: that network, exactly.
  adapted = lora.with_adapters(base_params, lora.adapters(adapted))
  attention = {"q", "kv", "out"} if model.get("num_kv_heads") else PROJECTIONS["attn"]
  block = _block(adapted, config)
  for layer, names in {**PROJECTIONS, "attn": attention}.items():
    for name in names:
      entry = block[layer][name]
      kernel, a, b = entry["kernel"], entry[lora.LORA_A], entry[lora.LORA_B]
      num_in = a.ndim - 1
      assert a.shape == kernel.shape[:num_in] + (4,) and b.shape == (4,) + kernel.shape[num_in:]
      assert not np.all(a == 0) and np.all(b == 0)
  np.testing.assert_array_equal(
    _logits(config, adapted, tokens), _logits(base, base_params, tokens)
  )


def test_adapters_shard_as_their_kernels_with_the_rank_replicated():
  config = _config(rank=4)
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), sharding.MESH_AXES)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, mesh)
  qkv, down = abstract.params["block_0"]["attn"]["qkv"], abstract.params["block_0"]["mlp"]["down"]
  spec = lambda leaf: tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
  assert spec(qkv["kernel"]) == ("fsdp", None, "tensor", None)
  assert spec(qkv[lora.LORA_A]) == ("fsdp", None)  # [embed, rank]
  assert spec(qkv[lora.LORA_B]) == (None, None, "tensor", None)  # [rank, qkv, heads, head_dim]
  assert spec(down[lora.LORA_A]) == ("tensor", None) and spec(down[lora.LORA_B]) == (None, "fsdp")
  # Adam's moments lie as their params do.
  mu = abstract.opt_state.inner_states[state_lib.TRAINABLE].inner_state[1][0].mu
  assert mu["block_0"]["attn"]["qkv"][lora.LORA_B].sharding == qkv[lora.LORA_B].sharding


def _fixed_batch(config):
  """The first training batch of the generated language (structure to learn, unlike noise)."""
  return sources.make_source(config).train_iterator().__next__()


def _fixed_loss(config, model, params, batch):
  """The training loss of batch at one fixed key (the same draws every call)."""
  rows = batch["tokens"].shape[0]
  nats, _ = objective.training_loss(
    params,
    batch,
    jax.random.PRNGKey(9),
    model=model,
    config=config,
    row_index=jnp.arange(rows),
    num_rows=rows,
  )
  return float(nats.sum() / batch["editable"].sum())


def _opt_state_size(opt_state) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(opt_state))


def test_training_moves_only_the_adapters_and_lowers_the_loss():
  config = _config(rank=4)
  # At the peak rate throughout (the cosine decays over 100 steps).
  config.optimizer.learning_rate, config.optimizer.warmup_steps = 3e-2, 1
  config.num_train_steps = 100
  mesh = _one_device()
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  start = jax.device_get(state)
  step = train.make_train_step(config, model, optimizer, mesh, state)
  batch = _fixed_batch(config)
  for _ in range(8):
    state, metrics = step(state, batch)
  end = jax.device_get(state)
  # Base params and their EMA bit for bit as they were; every adapter moved.
  jax.tree.map(
    np.testing.assert_array_equal,
    lora.without_adapters(end.params),
    lora.without_adapters(start.params),
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    lora.without_adapters(end.ema_params),
    lora.without_adapters(start.params),
  )
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), end.params, start.params)
  assert all(jax.tree.leaves(lora.adapters(moved))) and np.isfinite(metrics["grad_norm"])
  before = _fixed_loss(config, model, start.params, batch)
  after = _fixed_loss(config, model, end.params, batch)
  # Measured: 2.021 -> 1.997 nats/token (full fine-tuning at its own rate: 1.989), the same
  # draws before and after; ln 8 = 2.079 is the uniform guess.
  assert after < before - 0.01, (before, after)


def _steps(config, devices, num_steps=2):
  """num_steps LoRA train steps of config over devices: the final state on the host."""
  mesh = sharding.make_mesh(config, devices)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  step = train.make_train_step(config, model, optimizer, mesh, state)
  batch = _fixed_batch(config)
  for _ in range(num_steps):
    state, _ = step(state, sharding.device_batch(batch, mesh))
  return jax.device_get(state)


@pytest.mark.slow
def test_sharded_accumulated_lora_steps_match_one_device():
  """On a (2, 2, 2) mesh, with gradient accumulation, the adapters shard and train as on one
  device with the whole batch."""
  config = _config(rank=4)
  config.mesh.data = 1
  one = _steps(config, jax.devices()[:1])
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  config.training.grad_accum_steps = 2
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
    _steps(config, jax.devices()),
    one,
  )


def test_optimizer_state_holds_moments_for_the_adapters_only():
  """Adam's two moments for every adapter scalar and none for a frozen one (two step counts
  besides): the state scales with the rank, not with the model."""
  sizes = {}
  for rank in (0, 2, 4):
    config = _config(rank=rank)
    model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
    abstract = state_lib.abstract_state(config, model, optimizer, _one_device())
    sizes[rank] = (_opt_state_size(abstract.opt_state), abstract.params)
  total = sum(leaf.size for leaf in jax.tree.leaves(lora.without_adapters(sizes[2][1])))
  assert sizes[0][0] == 2 * total + 2  # Full fine-tuning: mu and nu of every param.
  for rank in (2, 4):
    adapter_size = lora.count_trainable(sizes[rank][1])
    assert sizes[rank][0] == 2 * adapter_size + 2
  assert lora.count_trainable(sizes[4][1]) == 2 * lora.count_trainable(sizes[2][1])
  assert lora.count_trainable(sizes[0][1]) == total  # No adapters: every param trains.


@pytest.mark.parametrize("scan_layers", [False, True])
def test_merged_params_are_the_adapted_network_at_rank_0(scan_layers):
  config, base = _config(rank=4, scan_layers=scan_layers), _config(rank=0, scan_layers=scan_layers)
  config.model.lora_alpha = 8.0
  tokens = _tokens(config)
  model = state_lib.build_model(config)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(2), tokens, jnp.ones((4,)))["params"])
  # Trained-looking adapters: B nonzero, so the update changes the network.
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))
  params = jax.tree_util.tree_map_with_path(
    lambda path, p: jax.random.normal(next(keys), p.shape) * 0.3 if lora.is_adapter(path) else p,
    params,
  )
  merged = lora.merged(params, config)
  assert not lora.has_adapters(merged)
  shapes = lambda tree: jax.tree.map(jnp.shape, tree)
  assert shapes(merged) == shapes(lora.without_adapters(params))
  adapted = _logits(config, params, tokens)
  assert (
    np.abs(np.asarray(adapted - _logits(base, lora.without_adapters(params), tokens))).max() > 1e-2
  )
  np.testing.assert_allclose(_logits(base, merged, tokens), adapted, rtol=1e-5, atol=1e-5)
  assert lora.merged(merged, base) is merged  # Nothing to fold.
  with pytest.raises(ValueError, match="model.lora_rank=0: these params hold LoRA adapters"):
    lora.merged(params, base)


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"lora_rank": -1}, "model.lora_rank must be an integer >= 0"),
    ({"lora_rank": 2.0}, "model.lora_rank must be an integer >= 0"),
    ({"lora_alpha": 0.0}, "model.lora_alpha must be a float > 0"),
    ({"lora_alpha": -8.0}, "model.lora_alpha must be a float > 0"),
    ({"lora_alpha": "16"}, "model.lora_alpha must be a float > 0"),
  ],
)
def test_bad_lora_settings_are_refused(changes, message):
  config = _config(rank=4)
  with config.ignore_type():
    for name, value in changes.items():
      config.model[name] = value
  with pytest.raises(ValueError, match=message) as error:
    config_lib.validate_config(config, num_devices=1, platform="cpu")
  assert "\n" not in str(error.value)


def test_the_network_checks_its_own_lora_fields():
  model = state_lib.build_model(_config(rank=0)).clone(lora_rank=-2)
  with pytest.raises(ValueError, match="lora_rank=-2 must be >= 0"):
    model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))


def _saved_workdir(path, config, ema_offset=0.25):
  """A workdir of config holding one checkpoint (step 7) whose EMA is params + ema_offset."""
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, _one_device())
  state = state.replace(ema_params=jax.tree.map(lambda p: p + ema_offset, state.params))
  manager = checkpoint.make_manager(workdir_lib.as_workdir(path).checkpoints, 1)
  checkpoint.save(manager, 7, state, {"next_batch_index": 7}, config)
  checkpoint.wait(manager)
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  return jax.device_get(state)


def test_starting_params_fold_a_lora_source_and_add_fresh_adapters():
  """training.init_from's params: a LoRA source's adapters folded into its kernels; this run's
  adapters (when it has a rank) the ones its own fresh init draws."""
  source_config, config = _config(rank=2), _config(rank=4)
  model = state_lib.build_model(source_config)
  tokens = _tokens(config)
  source = nn.meta.unbox(model.init(jax.random.PRNGKey(4), tokens, jnp.ones((4,)))["params"])
  source = jax.tree_util.tree_map_with_path(
    lambda path, p: p + 0.1 if lora.is_adapter(path) else p, source
  )
  started = state_lib.starting_params(config, source, source_config)
  merged = lora.merged(source, source_config)
  jax.tree.map(np.testing.assert_array_equal, lora.without_adapters(started), merged)
  fresh = state_lib.init_state(
    config, state_lib.build_model(config), state_lib.make_optimizer(config), _one_device()
  )
  jax.tree.map(np.testing.assert_array_equal, lora.adapters(started), lora.adapters(fresh.params))
  # Its logits at the start are the source's adapted network's.
  np.testing.assert_allclose(
    _logits(config, started, tokens), _logits(source_config, source, tokens), rtol=1e-5, atol=1e-5
  )
  full = state_lib.starting_params(_config(rank=0), source, source_config)
  assert not lora.has_adapters(full)


@pytest.mark.slow
def test_lora_run_from_a_trained_workdir_trains_resumes_and_samples(tmp_path, capsys):
  """configs/workdir.py:BASE with training.init_from=BASE and model.lora_rank: a fresh LoRA run
  at the base's EMA, 2 steps, resumed to 4, then sampled (docs/lora.md)."""
  base = _saved_workdir(tmp_path / "base", _config(rank=0))
  config = config_lib.load_config(f"workdir:{tmp_path / 'base'}")
  config.training.init_from = str(tmp_path / "base")
  config.model.lora_rank, config.model.lora_alpha = 2, 4.0
  config.num_train_steps, config.optimizer.warmup_steps = 2, 1
  config.eval.num_sequences, config.eval.batch_size, config.eval.discrete_steps = 16, 16, ""
  config.sample.num_samples, config.sample.trajectory = 2, False
  workdir = tmp_path / "lora"
  modes.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert "Starting from the EMA params of step 7" in out
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["lora_rank"] == 2 and saved["model"]["lora_alpha"] == 4.0
  loaded = _restored(config, workdir)
  assert int(loaded.step) == 2
  # The base params are the source's EMA, untouched by training; the adapters trained.
  jax.tree.map(np.testing.assert_array_equal, lora.without_adapters(loaded.params), base.ema_params)
  b = loaded.params["block_0"]["mlp"]["down"][lora.LORA_B]
  assert np.abs(b).max() > 0
  config.num_train_steps = 4
  modes.train_and_evaluate(config, workdir)
  assert "Resuming from the checkpoint of step 2" in capsys.readouterr().out
  assert int(_restored(config, workdir).step) == 4
  records = modes.sample_checkpoint(config_lib.load_config(f"workdir:{workdir}"), workdir)
  assert len(records) == 2 and records[0]["step"] == 4


def _restored(config, workdir):
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, sharding.make_mesh(config))
  manager = checkpoint.make_manager(pathlib.Path(workdir) / "checkpoints", 1)
  return jax.device_get(checkpoint.restore(manager, abstract).state)
