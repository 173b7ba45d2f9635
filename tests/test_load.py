"""md4jax.load: a workdir (newest or a given step, EMA or raw params) or a Hugging Face folder, as a
model ready for md4jax.sample and md4jax.nelbo; a path it cannot load is one line naming it."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import md4jax
from md4jax import config as config_lib
from md4jax.app import load
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """configs/tiny.py's workdir with checkpoints at steps 3 and 7; step k's EMA is params + k."""
  path = tmp_path_factory.mktemp("tiny")
  config = config_lib.load_config("tiny")
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(path).checkpoints, 3)
  for step in (3, 7):
    ema = jax.tree.map(lambda p, step=step: p + step, state.params)
    saved = state.replace(step=jnp.int32(step), ema_params=ema)
    checkpoint.save(manager, step, saved, {"next_batch_index": step}, config)
  checkpoint.wait(manager)
  (path / "config.json").write_text(config.to_json_best_effort(indent=2))
  return path, state.params


def test_a_workdir_loads_its_newest_ema_or_a_given_step(workdir):
  path, params = workdir
  loaded = md4jax.load(path)
  assert loaded.step == 7 and loaded.mask_id == 8 and loaded.config.data.seq_len == 16
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b + 7), loaded.params, params)
  earlier = md4jax.load(path, step=3, params="raw")
  assert earlier.step == 3
  jax.tree.map(np.testing.assert_array_equal, earlier.params, params)
  assert loaded.tokenizer.decode(loaded.tokenizer.encode("3 1 4")) == "3 1 4"
  assert loaded.language is not None and loaded.language.vocab_size == 8


def test_the_loaded_denoiser_samples_and_scores(workdir):
  loaded = md4jax.load(workdir[0])
  tokens, info = md4jax.sample(
    jax.random.PRNGKey(0),
    loaded.denoise_fn,
    batch_size=4,
    length=40,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    num_steps=4,
    block_size=8,
    context_length=16,  # Past the 16-token context, in windows.
  )
  tokens = np.asarray(tokens)
  assert tokens.shape == (4, 40) and tokens.max() < 8 and int(info["num_blocks"]) == 5
  nats = md4jax.nelbo(
    jax.random.PRNGKey(1), loaded.denoise_fn, tokens[:, :16], loaded.schedule, mask_id=8
  )
  assert nats.shape == (4,) and np.all(np.isfinite(np.asarray(nats)))
  # The denoiser is the network on the loaded params: its logits are the model's own.
  z = jnp.full((2, 16), 8, jnp.int32)
  expected = loaded.model.apply({"params": loaded.params}, z, None)
  np.testing.assert_array_equal(loaded.denoise_fn(z, jnp.ones(2)), expected)


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_a_hugging_face_folder_loads_with_transformers_logits(name):
  loaded = md4jax.load(GOLDEN / name)
  assert loaded.step is None and loaded.config.model.type == "ar"
  golden = np.load(GOLDEN / name / "logits.npz")
  logits = loaded.model.apply({"params": loaded.params}, jnp.asarray(golden["token_ids"]))
  scale = np.abs(golden["logits"]).max()
  np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=1e-4, atol=1e-5 * scale)
  assert loaded.tokenizer.vocab_size == loaded.config.data.vocab_size
  # Its denoiser is the causal model read shifted: AR decoding, one call a token.
  tokens, info = md4jax.sample(
    jax.random.PRNGKey(0),
    loaded.denoise_fn,
    batch_size=2,
    length=8,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    method="first_hitting",
    block_size=1,
    cache="exact",
    temperature=0.0,
  )
  shifted = np.concatenate([np.full((2, 1), loaded.mask_id), np.asarray(tokens)[:, :-1]], axis=1)
  greedy = np.argmax(loaded.model.apply({"params": loaded.params}, jnp.asarray(shifted)), -1)
  np.testing.assert_array_equal(np.asarray(tokens), greedy)
  assert int(info["nfe"]) == 8


def test_bad_paths_are_one_line_naming_the_path(workdir, tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "garbled").mkdir()
  (tmp_path / "garbled" / "config.json").write_text("{not json")
  (tmp_path / "bert").mkdir()
  (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
  (tmp_path / "untrained").mkdir()
  (tmp_path / "untrained" / "config.json").write_text((workdir[0] / "config.json").read_text())
  cases = {
    "missing": r"path='.*missing': no config.json there \(the folder does not exist\)",
    "empty": r"path='.*empty': no config.json there; name a workdir md4jax trained",
    "garbled": r"path='.*garbled': .*config.json is not JSON",
    "bert": r"path='.*bert': .*'bert'",
    "untrained": r"path='.*untrained': no checkpoint in .*untrained/checkpoints",
  }
  for name, message in cases.items():
    with pytest.raises((ValueError, checkpoint.CheckpointError), match=message) as raised:
      md4jax.load(tmp_path / name)
    assert "\n" not in str(raised.value), name
  assert not (tmp_path / "untrained" / "checkpoints").exists()  # Never created.
  with pytest.raises(
    checkpoint.CheckpointError, match=r"no checkpoint of step 5 .*steps there: 3, 7"
  ):
    md4jax.load(workdir[0], step=5)
  with pytest.raises(load.LoadError, match=r"params='best' is unknown"):
    md4jax.load(workdir[0], params="best")
  with pytest.raises(load.LoadError, match=r"config.sample.nosuch: the config has no key"):
    md4jax.load(workdir[0], overrides={"sample.nosuch": 1})
