"""AR → MDM adaptation (configs/adapt.py, md4jax.training.adaptation, model.shifted_prediction):
the annealed attention, the shifted denoiser against the ar model it starts from, init_from and
the one-line errors."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import adaptation, checkpoint, objective, train
from md4jax.training import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ar_config():
  config = config_lib.load_config("tiny_ar")
  config.model.num_layers = 2
  return config


def _adapted(config, anneal_steps=10):
  adapted = config.copy_and_resolve_references()
  adapted.model.type = "mdm"
  adapted.model.shifted_prediction = True
  adapted.training.attention_anneal_steps = anneal_steps
  return adapted


def test_annealed_attention_widens_from_causal_to_full():
  config = _adapted(_ar_config(), anneal_steps=10)
  length, key = config.data.seq_len, jax.random.PRNGKey(3)
  causal = np.tril(np.ones((length, length), bool))
  at = lambda step: np.asarray(adaptation.annealed_attention(key, step, config))
  np.testing.assert_array_equal(at(0), causal)
  for step in (10, 11, 500):
    assert at(step).all(), step
  future = ~causal
  shares = [at(step)[future].mean() for step in (2, 5, 8)]
  # One Bernoulli(s / N) per future pair: 120 pairs, so each share is within ±0.2 of s / N.
  np.testing.assert_allclose(shares, [0.2, 0.5, 0.8], atol=0.2)
  assert shares[0] < shares[1] < shares[2] and (at(5) | causal).sum() == at(5).sum()
  config.training.attention_anneal_steps = 0
  assert adaptation.annealed_attention(key, 0, config) is None


def _packed_batch(vocab_size):
  """Two rows: one whole document, and two documents of 7 and 9 tokens packed."""
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, vocab_size)
  segments = jnp.asarray([[1] * 16, [1] * 7 + [2] * 9])
  positions = jnp.asarray([list(range(16)), list(range(7)) + list(range(9))])
  return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def test_shifted_denoiser_at_step_0_is_the_ar_model():
  """At step 0 (causal) the adapted denoiser's logits at a position whose document prefix is
  unmasked are the ar model's next-token logits, masked or not the position itself; a masked
  token before it changes them, and so do the full attention and the unshifted network."""
  ar_config = _ar_config()
  config, vocab = _adapted(ar_config), ar_config.data.vocab_size
  ar_model, model = state_lib.build_model(ar_config), state_lib.build_model(config)
  batch = _packed_batch(vocab)
  params = ar_model.init(jax.random.PRNGKey(1), batch["tokens"])["params"]
  segments, positions = batch["segment_ids"], batch["positions"]
  ar_logits = ar_model.apply(
    {"params": params},
    objective.ar_inputs(batch["tokens"], vocab, positions),
    None,
    segments,
    positions,
  )
  masked = jax.random.bernoulli(jax.random.PRNGKey(2), 0.3, batch["tokens"].shape)
  z = jnp.where(masked, vocab, batch["tokens"])
  causal = adaptation.annealed_attention(jax.random.PRNGKey(4), 0, config)
  logits = objective.denoiser(model, params, batch, config=config, attention_mask=causal)(z, None)
  # The first masked position of each document: all its prefix is clean.
  document_start = np.asarray(positions) == 0
  masked_before = np.zeros(masked.shape, bool)
  for b in range(masked.shape[0]):
    seen = False
    for i in range(masked.shape[1]):
      seen = False if document_start[b, i] else seen
      masked_before[b, i] = seen
      seen = seen or bool(masked[b, i])
  clean_prefix = ~masked_before
  assert (clean_prefix & np.asarray(masked)).any() and masked_before.any()
  np.testing.assert_allclose(logits[clean_prefix], ar_logits[clean_prefix], rtol=1e-5, atol=1e-6)
  far = lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(-1) > 1e-3
  assert far(logits, ar_logits)[masked_before].all()
  full = objective.denoiser(model, params, batch, config=config)(z, None)
  # A document's last position reads its whole document either way.
  last = np.asarray(segments) != np.concatenate([segments[:, 1:], np.zeros((2, 1), int)], 1)
  assert far(full, ar_logits)[clean_prefix & ~last].all()
  # The samplers see the same shifted denoiser as training and the bounds.
  sampled = objective.sampling_denoiser(model, params, config, segments, positions)(z, None)
  np.testing.assert_array_equal(sampled, full)
  unshifted = config.copy_and_resolve_references()
  unshifted.model.shifted_prediction = False
  plain = objective.denoiser(model, params, batch, config=unshifted, attention_mask=causal)(z, None)
  # (A masked first token reads as BOS: there the two coincide.)
  assert far(plain, ar_logits)[clean_prefix & ~document_start].all()


@pytest.mark.parametrize("step", [0, 5])
@pytest.mark.slow
def test_train_step_trains_under_the_annealed_attention(step):
  """train_step's loss is objective.sequence_nats of its own key and draws under the step's
  annealed pattern (at step 0 the causal one), not under full attention."""
  config = _adapted(_ar_config(), anneal_steps=10)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  state = state_lib.init_state(config, model, optimizer, mesh).replace(step=step)
  batch = {**_packed_batch(config.data.vocab_size), "editable": jnp.ones((2, 16), bool)}
  with sharding.activation_rules(mesh):
    _, metrics = train.train_step(state, batch, model=model, optimizer=optimizer, config=config)
  key = jax.random.fold_in(state.rng, state.step)

  def loss(attention_mask):
    nats = objective.sequence_nats(
      state.params,
      batch,
      key,
      model=model,
      config=config,
      estimator=config.training.estimator,
      t_sampling="stratified",
      row_index=jnp.arange(2),
      num_rows=2,
      mask_rates=objective.training_mask_rates(config),
      attention_mask=attention_mask,
    )
    return float(nats.sum() / 32)

  causal = jnp.tril(jnp.ones((16, 16), bool))
  annealed = causal if step == 0 else adaptation.annealed_attention(key, step, config)
  assert step == 0 or not np.array_equal(annealed, causal) and not np.asarray(annealed).all()
  reported = float(metrics["loss"])
  assert reported == pytest.approx(loss(annealed), rel=1e-5)  # Measured: equal.
  # Full attention's loss differs (measured: by 6e-4 of it at step 0, 4e-4 at step 5, an
  # untrained network's attention being near uniform), and at step 5 the causal one's (1.5e-3).
  assert reported != pytest.approx(loss(None), rel=1e-4)
  assert step == 0 or reported != pytest.approx(loss(causal), rel=1e-4)


def _saved_workdir(path, config, ema_offset=0.5):
  """A workdir of `config` holding one checkpoint (step 7) whose EMA is params + ema_offset."""
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  state = state.replace(ema_params=jax.tree.map(lambda p: p + ema_offset, state.params))
  manager = checkpoint.make_manager(workdir_lib.as_workdir(path).checkpoints, 1)
  checkpoint.save(manager, 7, state, {"next_batch_index": 7}, config)
  checkpoint.wait(manager)
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  return state, mesh


def _fresh_run(config, workdir):
  """A Run of config in a new workdir: its step-0 state (a random init, or init_from's)."""
  run = modes.Run(config, workdir)
  try:
    return run.state, run
  finally:
    run.close()


def test_init_from_starts_a_fresh_mdm_run_at_the_ar_ema(tmp_path, capsys):
  ar_state, _ = _saved_workdir(tmp_path / "ar", _ar_config())
  config = config_lib.load_config(f"adapt:{tmp_path / 'ar'}")
  assert config.model.type == "mdm" and config.model.shifted_prediction
  assert config.training.init_from == str(tmp_path / "ar")
  assert config.training.attention_anneal_steps > 0
  config.training.attention_anneal_steps = 10
  state, run = _fresh_run(config, tmp_path / "adapted")
  assert int(state.step) == 0 and run.restored_step is None
  assert (
    f"Starting from the EMA params of step 7 in {tmp_path / 'ar' / 'checkpoints'} "
    "(model.type 'ar', now 'mdm')" in capsys.readouterr().out
  )
  jax.tree.map(np.testing.assert_array_equal, state.params, ar_state.ema_params)
  jax.tree.map(np.testing.assert_array_equal, state.ema_params, ar_state.ema_params)
  fresh = run.optimizer.init(state.params)
  jax.tree.map(np.testing.assert_array_equal, state.opt_state, fresh)
  # Laid out as the run's own fresh state.
  expected = state_lib.state_shardings(run.abstract_state)
  assert jax.tree.map(lambda a: a.sharding, state) == expected


def test_adaptation_errors_name_the_key(tmp_path):
  config = _adapted(_ar_config())
  config.training.init_from = str(tmp_path / "missing")
  with pytest.raises(ValueError, match="training.init_from=.*missing.*no config.json there"):
    config_lib.workdir_config(config.training.init_from, "training.init_from")
  with pytest.raises(ValueError, match="training.init_from=.*missing.*no config.json there"):
    _fresh_run(config, tmp_path / "run_missing")
  wider = _ar_config()
  wider.model.model_dim = 64
  _saved_workdir(tmp_path / "wide", wider)
  config.training.init_from = str(tmp_path / "wide")
  with pytest.raises(ValueError, match=r"do not fit this model .*\(64,"):
    _fresh_run(config, tmp_path / "run_wide")
  _saved_workdir(tmp_path / "unreadable", _ar_config())
  (tmp_path / "unreadable" / "checkpoints" / "7").rename(
    tmp_path / "unreadable" / "checkpoints" / "x"
  )
  config.training.init_from = str(tmp_path / "unreadable")
  with pytest.raises(checkpoint.CheckpointError, match="init_from=.*unreadable.*: no checkpoint"):
    _fresh_run(config, tmp_path / "run_unreadable")
  shutil.rmtree(tmp_path / "unreadable" / "checkpoints")
  with pytest.raises(checkpoint.CheckpointError, match="init_from=.*unreadable.*: no checkpoint"):
    _fresh_run(config, tmp_path / "run_unreadable")
  assert not (tmp_path / "unreadable" / "checkpoints").exists()  # Never created.
  mdm = config_lib.load_config("tiny")
  (tmp_path / "mdm").mkdir()
  (tmp_path / "mdm" / "config.json").write_text(mdm.to_json_best_effort())
  with pytest.raises(ValueError, match="holds a model.type='mdm' model; configs/adapt.py adapts"):
    config_lib.load_config(f"adapt:{tmp_path / 'mdm'}")
  with pytest.raises(ValueError, match=r"configs/adapt.py:PATH='.*missing': no config.json there"):
    config_lib.load_config(f"adapt:{tmp_path / 'missing'}")


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"model.type": "ar"}, "model.shifted_prediction adapts a masked diffusion model"),
    ({"model.shifted_prediction": 1}, "model.shifted_prediction must be true or false"),
    ({"training.attention_anneal_steps": -1}, "attention_anneal_steps must be an integer >= 0"),
    ({"training.attention_anneal_steps": 30}, "must be at most num_train_steps=20"),
    ({"diffusion.block_size": 4}, "block diffusion .* has its own attention pattern"),
    ({"sample.cache": "prefix"}, "sample.cache='prefix' calls the network on cached blocks"),
    ({"training.init_from": 3}, "training.init_from must be a workdir path"),
    (
      {"model.attention": "splash", "data.seq_len": 128},
      "attention_anneal_steps: the splash kernel takes no attention mask",
    ),
  ],
)
def test_bad_adaptation_settings_are_refused(changes, message):
  config = _adapted(config_lib.load_config("tiny"))
  with config.ignore_type():
    for name, value in changes.items():
      section, key = name.split(".")
      config[section][key] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate_config(config, num_devices=1, platform="tpu")


def test_defaults_change_nothing():
  """Without the new keys the denoiser is the network on z itself, as before."""
  config = config_lib.load_config("tiny")
  model = state_lib.build_model(config)
  batch = {"tokens": jnp.ones((2, 16), jnp.int32), "segment_ids": None, "positions": None}
  params = model.init(jax.random.PRNGKey(0), batch["tokens"])["params"]
  z = jnp.where(jnp.arange(16) % 3 == 0, 8, batch["tokens"])
  np.testing.assert_array_equal(
    objective.denoiser(model, params, batch, config=config)(z, None),
    model.apply({"params": params}, z),
  )


@pytest.mark.slow
def test_cli_adapts_an_ar_workdir(tmp_path):
  """The commands docs/adapt.md gives: an ar run, then configs/adapt.py on its workdir."""
  run = lambda *args: subprocess.run(
    [sys.executable, "-m", "md4jax.main", *args], cwd=ROOT, capture_output=True, text=True
  )
  short = ["--config.num_train_steps=4", "--config.optimizer.warmup_steps=1"]
  short += ["--config.sample.num_samples=1", "--config.sample.trajectory=False"]
  ar = tmp_path / "ar"
  result = run("--config=configs/tiny_ar.py", f"--workdir={ar}", *short)
  assert result.returncode == 0, result.stderr[-3000:]
  adapted = tmp_path / "adapted"
  anneal = "--config.training.attention_anneal_steps=2"
  result = run(f"--config=configs/adapt.py:{ar}", f"--workdir={adapted}", *short, anneal)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"Starting from the EMA params of step 4 in {ar / 'checkpoints'}" in result.stdout
  saved = json.loads((adapted / "config.json").read_text())
  assert saved["model"]["type"] == "mdm" and saved["model"]["shifted_prediction"]
  assert "nelbo_bits_per_token" in json.loads((adapted / "eval.json").read_text())
