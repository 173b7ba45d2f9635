"""md4jax.convert's import, streamed: tensor by tensor through hf_tensors.layout (the one mapping),
each param placed on the mesh as it is whole, and a step-0 checkpoint of the params alone that a
resuming run completes (EMA = params, a fresh optimizer state). benchmarks/convert_memory.py
measures the memory it saves; these tests check that nothing else changed."""

import json
import pathlib
import shutil
import weakref

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import safetensors.numpy

from md4jax import config as config_lib
from md4jax import convert
from md4jax.app import hf as hf_lib
from md4jax.app import load, modes
from md4jax.model import hf_config, hf_folder, hf_tensors
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective
from md4jax.training import state as state_lib

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
FOLDERS = ("llada", "dream", "hf_llama", "hf_qwen2")


def _in_memory(folder, config, hf, vocab_size=0):
  """The params of the in-memory mapping: every tensor read at once, then converted."""
  return hf_tensors.to_md4jax(
    hf_folder.read_weights(folder),
    hf_config.model_options(hf),
    config.model.scan_layers,
    vocab_size,
    hf["model_type"],
  )


def _assert_bit_equal(expected, got):
  flat_expected = jax.tree_util.tree_flatten_with_path(expected)[0]
  flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
  assert [path for path, _ in flat_got] == [path for path, _ in flat_expected]
  for (path, a), (_, b) in zip(flat_expected, flat_got):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, path
    assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def _write_shards(folder, tensors, order):
  """tensors in two shard files of folder and an index: every other name of `order` in each."""
  files = [f"model-0000{k + 1}-of-00002.safetensors" for k in range(2)]
  weight_map = {}
  for k, file in enumerate(files):
    shard = {n: tensors[n] for n in order[k::2]}
    hf_folder.write_safetensors(folder / file, shard, {"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))
  index = {"metadata": {}, "weight_map": weight_map}
  (folder / hf_folder.INDEX_FILE).write_text(json.dumps(index))


def _sharded_copy(name, folder, tensors=None, order=None):
  """The golden folder (or its `tensors`) in two shard files: every other tensor of `order`
  (default: sorted) in each, so q, k and v of a layer lie in different files."""
  shutil.copytree(GOLDEN / name, folder)
  tensors = tensors or hf_folder.read_weights(folder)
  (folder / hf_folder.WEIGHTS_FILE).unlink()
  _write_shards(folder, tensors, order or sorted(tensors))
  return folder


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_streamed_params_equal_the_in_memory_mapping_bit_for_bit(name, scan_layers):
  base = config_lib.base_config()
  base.model.scan_layers = scan_layers
  config, hf = hf_lib.folder_config(GOLDEN / name, base)
  expected = _in_memory(GOLDEN / name, config, hf)
  _assert_bit_equal(expected, hf_lib.folder_params(GOLDEN / name, config, hf))
  mesh = sharding.make_mesh(config)
  placed = hf_lib.folder_params(GOLDEN / name, config, hf, mesh=mesh)
  _assert_bit_equal(expected, placed)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(placed))


def test_params_are_sharded_over_the_mesh_as_a_run_lays_them_out():
  config, hf = hf_lib.folder_config(GOLDEN / "llada")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2  # The 8 test devices.
  mesh = sharding.make_mesh(config)
  placed = hf_lib.folder_params(GOLDEN / "llada", config, hf, mesh=mesh)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, mesh)
  expected = jax.tree.map(lambda a: a.sharding, abstract.params)
  assert jax.tree.map(lambda a: a.sharding, placed) == expected
  kernel = placed["block_0"]["mlp"]["gate"]["kernel"]  # [D, mlp]: D over fsdp, mlp over tensor.
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert {shard.data.shape for shard in kernel.addressable_shards} == {(32, 48)}
  _assert_bit_equal(_in_memory(GOLDEN / "llada", config, hf), placed)


@pytest.mark.parametrize("name", ["llada", "hf_qwen2"])
def test_a_sharded_folder_converts_the_same(tmp_path, name):
  folder = _sharded_copy(name, tmp_path / "sharded")
  config, hf = hf_lib.folder_config(folder)
  headers = hf_folder.tensor_headers(folder)
  assert len({header.path for header in headers.values()}) == 2
  streamed = hf_lib.folder_params(folder, config, hf, mesh=sharding.make_mesh(config))
  _assert_bit_equal(_in_memory(GOLDEN / name, config, hf), streamed)
  convert.import_hf(folder, tmp_path / "from_shards")
  convert.import_hf(GOLDEN / name, tmp_path / "from_one")
  one, shards = load.load(tmp_path / "from_one"), load.load(tmp_path / "from_shards")
  _assert_bit_equal(one.params, shards.params)


@pytest.mark.parametrize("head_first", [True, False])
def test_a_tied_head_is_checked_wherever_it_lies(tmp_path, head_first):
  """A tied model's files may hold its head: before or after the embedding, in another shard,
  it must equal the embedding rows."""
  embed, head = "model.embed_tokens.weight", "lm_head.weight"
  tensors = hf_folder.read_weights(GOLDEN / "hf_qwen2")
  tensors[head] = tensors[embed].copy()
  others = sorted(n for n in tensors if n not in (embed, head))
  order = [head, embed, *others] if head_first else [embed, head, *others]  # One in each shard.
  folder = _sharded_copy("hf_qwen2", tmp_path / "tied", tensors, order)
  names = list(hf_folder.tensor_headers(folder))
  assert (names.index(head) < names.index(embed)) == head_first
  config, hf = hf_lib.folder_config(folder)
  mesh = sharding.make_mesh(config)
  _assert_bit_equal(
    _in_memory(GOLDEN / "hf_qwen2", config, hf), hf_lib.folder_params(folder, config, hf, mesh=mesh)
  )
  tensors[head][5, 7] += 1.0
  _write_shards(folder, tensors, order)
  with pytest.raises(ValueError, match="lm_head.weight differs from the embedding"):
    hf_lib.folder_params(folder, config, hf, mesh=mesh)


def test_tensors_are_read_one_at_a_time_and_released(monkeypatch):
  """No tensor the files hold outlives its conversion: each is gone before the next is read."""
  read = hf_folder.read_tensor
  alive = []

  def tracked(path, name):
    assert all(ref() is None for ref in alive), "a tensor read earlier is still held"
    tensor = read(path, name)
    alive.append(weakref.ref(tensor))
    return tensor

  monkeypatch.setattr(hf_folder, "read_tensor", tracked)
  for name in ("llada", "hf_llama"):  # float32 (read as is) and bfloat16 (widened).
    config, hf = hf_lib.folder_config(GOLDEN / name)
    hf_lib.folder_params(GOLDEN / name, config, hf, mesh=sharding.make_mesh(config))
    assert len(alive) == len(hf_folder.read_weights(GOLDEN / name))
    alive.clear()


def _rewritten(tmp_path, edit):
  folder = tmp_path / "bad"
  shutil.copytree(GOLDEN / "hf_llama", folder)
  tensors = hf_folder.read_weights(folder)
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(folder / hf_folder.WEIGHTS_FILE))
  return folder


@pytest.mark.parametrize(
  "edit, message",
  [
    (
      lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}),
      "Tensor 'model.norm.weight' has shape [63], but config.json implies [64].",
    ),
    (lambda t: t.pop("lm_head.weight"), "The safetensors files have no tensor 'lm_head.weight'."),
    (
      lambda t: t.update({"model.extra.weight": np.ones(2, np.float32)}),
      "Unexpected tensors in the safetensors files: ['model.extra.weight'].",
    ),
    (
      lambda t: t.update({"model.steps": np.ones(2, np.int64)}),
      "tensor 'model.steps' is int64, not a float dtype.",
    ),
  ],
)
def test_bad_tensors_are_named_before_any_weight_is_read(tmp_path, monkeypatch, edit, message):
  folder = _rewritten(tmp_path, edit)
  config, hf = hf_lib.folder_config(folder)

  def never(*_):
    raise AssertionError("a weight was read")

  monkeypatch.setattr(hf_folder, "read_tensor", never)
  with pytest.raises(ValueError) as raised:
    hf_lib.folder_params(folder, config, hf, mesh=sharding.make_mesh(config))
  assert message in str(raised.value)
  # The same words as the in-memory mapping's (or reader's) error.
  with pytest.raises(ValueError) as in_memory:
    _in_memory(folder, config, hf)
  assert message in str(in_memory.value)
  with pytest.raises(ValueError, match="no tensor|has shape|Unexpected|not a float"):
    convert.import_hf(folder, tmp_path / "out")
  assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_tensor_in_two_shards_is_named(tmp_path):
  folder = _sharded_copy("llada", tmp_path / "sharded")
  first, second = sorted(folder.glob("model-*.safetensors"))
  shard, other = hf_folder.read_safetensors(first), hf_folder.read_safetensors(second)
  repeated = sorted(other)[0]
  hf_folder.write_safetensors(first, {**shard, repeated: other[repeated]}, {"format": "pt"})
  with pytest.raises(ValueError, match=f"repeats tensors of another shard: .*{repeated}"):
    hf_folder.tensor_headers(folder)


def _expected_state(config, params):
  """The step-0 state the import used to save: state_from_params of the converted params."""
  return state_lib.state_from_params(config, state_lib.make_optimizer(config), params)


def _restored(workdir, config=None):
  config = config or config_lib.workdir_config(workdir, "test")
  mesh = sharding.make_mesh(config)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, mesh)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 1)
  return checkpoint.restore(manager, abstract), abstract


def test_the_step_0_checkpoint_holds_the_params_alone(tmp_path):
  convert.import_hf(GOLDEN / "llada", tmp_path / "w")
  step = tmp_path / "w" / "checkpoints" / "0"
  assert (step / checkpoint.START_ITEM).is_dir() and not (step / "state").exists()
  config = config_lib.workdir_config(tmp_path / "w", "test")
  restored, abstract = _restored(tmp_path / "w", config)
  assert restored.step == 0 and restored.data_state == {"next_batch_index": 0}
  network = _in_memory(GOLDEN / "llada", *hf_lib.folder_config(GOLDEN / "llada"))
  expected = _expected_state(config, network)
  for field in ("step", "params", "opt_state", "ema_params", "rng"):
    _assert_equal_trees(getattr(expected, field), getattr(restored.state, field))
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  assert jax.tree.map(lambda a: a.sharding, restored.state) == shardings


@pytest.mark.parametrize("schedule", ["linear", "learned_poly"])
def test_a_start_restores_the_state_state_from_params_makes(tmp_path, schedule):
  """checkpoint.save_start's params, restored: the state state_from_params gives, a learned
  schedule's θ included (no converted model has one: the case is the checkpoint's own)."""
  base = config_lib.base_config()
  base.diffusion.schedule = schedule
  config, hf = hf_lib.folder_config(GOLDEN / "hf_qwen2", base)
  config.mesh.data, config.mesh.fsdp = 4, 2
  mesh = sharding.make_mesh(config)
  params = hf_lib.folder_params(GOLDEN / "hf_qwen2", config, hf, mesh=mesh)
  start = convert._start(config, params, mesh)  # pylint: disable=protected-access
  assert (objective.SCHEDULE_PARAMS in start["params"]) == (schedule != "linear")
  checkpoint.save_start(tmp_path / "checkpoints", 0, start, {"next_batch_index": 0}, config, 1)
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  restored, abstract = _restored(tmp_path, config)
  expected = _expected_state(config, _in_memory(GOLDEN / "hf_qwen2", config, hf))
  for field in ("step", "params", "opt_state", "ema_params", "rng"):
    _assert_equal_trees(getattr(expected, field), getattr(restored.state, field))
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  assert jax.tree.map(lambda a: a.sharding, restored.state) == shardings


def _assert_equal_trees(expected, got):
  assert jax.tree.structure(expected) == jax.tree.structure(got)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_an_optimizer_whose_fresh_state_is_not_zeros_gets_the_whole_state(tmp_path, monkeypatch):
  config, hf = hf_lib.folder_config(GOLDEN / "hf_llama")
  params = hf_lib.folder_params(GOLDEN / "hf_llama", config, hf, mesh=sharding.make_mesh(config))
  assert convert._start(config, params, sharding.make_mesh(config)) is not None  # pylint: disable=protected-access
  ones = optax.GradientTransformation(
    lambda p: jax.tree.map(jnp.ones_like, p), lambda u, s, p=None: (u, s)
  )
  monkeypatch.setattr(state_lib, "make_optimizer", lambda config: ones)
  assert convert._start(config, params, sharding.make_mesh(config)) is None  # pylint: disable=protected-access
  convert.import_hf(GOLDEN / "hf_llama", tmp_path / "w")
  assert (tmp_path / "w" / "checkpoints" / "0" / "state").is_dir()
  restored, _ = _restored(tmp_path / "w")
  jax.tree.map(np.testing.assert_array_equal, restored.state.opt_state, ones.init(params))
  _assert_equal_trees(restored.state.params, restored.state.ema_params)


def _small_run(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  config.num_train_steps, config.optimizer.warmup_steps = 2, 1
  config.data.seq_len, config.batch_size = 16, 8
  config.eval.num_sequences = config.eval.batch_size = 8
  config.sample.num_samples, config.sample.trajectory, config.sample.num_steps = 1, False, 4
  return config


@pytest.mark.slow
def test_a_converted_workdir_resumes_trains_loads_and_starts_another_run(tmp_path):
  """md4jax.load, a resumed run (train, then its evaluation and samples) and training.init_from
  on a converted workdir (a Llama on the generated language: LLaDA's own mask id, never
  predicted, would be a token of it)."""
  base = _small_run(config_lib.base_config())
  convert.import_hf(GOLDEN / "hf_llama", tmp_path / "w", base)
  network = load.load(tmp_path / "w").params  # Its EMA: the converted params.
  _assert_bit_equal(
    _in_memory(GOLDEN / "hf_llama", *hf_lib.folder_config(GOLDEN / "hf_llama")), network
  )
  config = config_lib.workdir_config(tmp_path / "w", "test")
  run = modes.Run(config, tmp_path / "w")
  try:
    assert run.restored_step == 0
    fresh = run.optimizer.init(run.state.params)
    jax.tree.map(np.testing.assert_array_equal, run.state.opt_state, fresh)
  finally:
    run.close()
  modes.train_and_evaluate(config, tmp_path / "w")
  manager = checkpoint.make_manager(workdir_lib.as_workdir(tmp_path / "w").checkpoints, 3)
  assert manager.all_steps() == [0, 2]
  assert (tmp_path / "w" / "checkpoints" / "2" / "state").is_dir()  # Training saves the state.
  trained = load.load(tmp_path / "w", params="raw")
  assert trained.step == 2
  moved = jax.tree.map(
    lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), network, trained.params
  )
  assert any(jax.tree.leaves(moved))
  at_start = load.load(tmp_path / "w", step=0)
  _assert_bit_equal(network, at_start.params)
  # training.init_from: a new run starts from the workdir's newest EMA.
  other = _small_run(config_lib.base_config())
  other = hf_lib.converted_config(
    other, hf_config.model_options(hf_folder.read_config(GOLDEN / "hf_llama")), "mdm"
  )
  other.training.init_from = str(tmp_path / "w")
  run = modes.Run(other, tmp_path / "other")
  try:
    assert run.restored_step is None
    _assert_bit_equal(load.load(tmp_path / "w").params, run.state.params)
  finally:
    run.close()
