"""Hugging Face Llama / Qwen2 weights in and out (md4jax.convert), against transformers' own logits.

The golden folders (tests/golden/make_hf_golden.py, run with transformers and torch, which this
test does not need) hold tiny random models with grouped-query attention: Llama untied in
bfloat16, Qwen2 tied with its q/k/v biases in float32, each with its causal logits. The
equal-heads path (md4jax's fused qkv) is checked on the same folders with each key/value head
repeated, which computes the same logits.
"""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from md4jax import config as config_lib
from md4jax import convert
from md4jax.model import hf_config, hf_folder
from md4jax.model.transformer import Transformer
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
MODELS = ("hf_llama", "hf_qwen2")


def restored_params(workdir):
  """(config, model, EMA params) of the workdir's newest checkpoint, through md4jax's restore."""
  config = config_lib.from_saved(json.loads((pathlib.Path(workdir) / "config.json").read_text()))
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 1)
  restored = checkpoint.restore(manager, state_lib.abstract_state(config, model, optimizer, mesh))
  assert restored.step == 0 and restored.data_state == {"next_batch_index": 0}
  return config, model, restored.state


@pytest.mark.parametrize("name, scan_layers", [("hf_llama", False), ("hf_qwen2", True)])
def test_converted_logits_equal_transformers(tmp_path, name, scan_layers):
  base = config_lib.base_config()
  base.model.scan_layers = scan_layers  # Stacked blocks: the other layout of the same params.
  convert.import_hf(GOLDEN / name, tmp_path, base)
  config, model, state = restored_params(tmp_path)
  golden = np.load(GOLDEN / name / "logits.npz")
  logits = np.asarray(model.apply({"params": state.ema_params}, jnp.asarray(golden["token_ids"])))
  # Float32 rounding differs between two implementations by a few ulps of the terms summed, not
  # of the result: a logit near 0 has no relative precision, so the absolute tolerance is tied to
  # the logits' scale (measured: 2e-6, i.e. 7e-7 of the largest |logit|, 3.0).
  scale = np.abs(golden["logits"]).max()
  np.testing.assert_allclose(logits, golden["logits"], rtol=1e-4, atol=1e-5 * scale)
  jax.tree.map(np.testing.assert_array_equal, state.params, state.ema_params)
  assert config.model.type == "ar" and config.model.num_kv_heads == 2
  assert config.model.qkv_bias == config.model.tie_embeddings == (name == "hf_qwen2")
  # The mask row V is the mean token row; tied logits never read it.
  embedding = np.asarray(state.params["embed"]["embedding"])
  assert embedding.shape == (97, 64)
  np.testing.assert_allclose(embedding[96], embedding[:96].mean(0), rtol=1e-6, atol=1e-7)
  assert (tmp_path / "tokenizer.json").is_file() and config.data.tokenizer == "bpe"
  # Weight decay: matrices only; the q/k/v biases are [3, H, Dh] or [H, Dh] but still biases.
  decayed = jax.tree_util.tree_flatten_with_path(state_lib.weight_decay_mask(state.params))[0]
  assert [p for p, d in decayed if d and "bias" in jax.tree_util.keystr(p)] == []
  assert any("bias" in jax.tree_util.keystr(p) for p, _ in decayed) == config.model.qkv_bias


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact(tmp_path, name):
  convert.import_hf(GOLDEN / name, tmp_path / "in")
  hf = convert.export_hf(tmp_path / "in", tmp_path / "out", log=lambda _: None)
  original = hf_folder.read_weights(GOLDEN / name)
  exported = hf_folder.read_weights(tmp_path / "out")
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and exported[key].shape == value.shape, key
    assert exported[key].tobytes() == value.tobytes(), key
  # Laid out as the safetensors library writes it: the very file save_pretrained wrote.
  weights = hf_folder.WEIGHTS_FILE
  assert (tmp_path / "out" / weights).read_bytes() == (GOLDEN / name / weights).read_bytes()
  assert hf == {**json.loads((GOLDEN / name / "config.json").read_text()), "head_dim": 16}
  convert.import_hf(tmp_path / "out", tmp_path / "again")
  first, again = restored_params(tmp_path / "in")[2], restored_params(tmp_path / "again")[2]
  jax.tree.map(np.testing.assert_array_equal, first.params, again.params)


def _equal_heads_folder(name, folder):
  """The golden folder with each key/value head repeated H / Hkv times (num_key_value_heads = H):
  grouped-query attention reads query head h against key/value head h // (H / Hkv), so the
  repeated heads compute the same function, through md4jax's fused qkv path."""
  hf = json.loads((GOLDEN / name / "config.json").read_text())
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  assert heads > kv_heads  # Else there would be nothing to repeat.
  tensors = hf_folder.read_weights(GOLDEN / name)
  for key in [k for k in tensors if re.search(r"\.[kv]_proj\.(weight|bias)$", k)]:
    value = tensors[key]
    grouped = value.reshape(kv_heads, -1, *value.shape[1:])  # [Hkv, Dh(, D)]
    tensors[key] = np.repeat(grouped, heads // kv_heads, axis=0).reshape(-1, *value.shape[1:])
  folder.mkdir()
  hf_folder.write_safetensors(folder / hf_folder.WEIGHTS_FILE, tensors, {"format": "pt"})
  (folder / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": heads}))
  shutil.copy(GOLDEN / name / hf_folder.TOKENIZER_FILE, folder)
  return {**hf, "num_key_value_heads": heads}


@pytest.mark.parametrize("name", MODELS)
def test_equal_heads_convert_through_the_fused_qkv(tmp_path, name):
  hf = _equal_heads_folder(name, tmp_path / "hf")
  convert.import_hf(tmp_path / "hf", tmp_path / "in")
  config, model, state = restored_params(tmp_path / "in")
  assert config.model.num_kv_heads == 0
  attn = state.ema_params["block_0"]["attn"]
  assert sorted(attn) == ["out", "qkv"] and attn["qkv"]["kernel"].shape == (64, 3, 4, 16)
  assert ("bias" in attn["qkv"]) == (name == "hf_qwen2")  # [3, H, Dh] for Qwen2.
  golden = np.load(GOLDEN / name / "logits.npz")
  logits = np.asarray(model.apply({"params": state.ema_params}, jnp.asarray(golden["token_ids"])))
  scale = np.abs(golden["logits"]).max()  # As test_converted_logits_equal_transformers.
  np.testing.assert_allclose(logits, golden["logits"], rtol=1e-4, atol=1e-5 * scale)
  exported = convert.export_hf(tmp_path / "in", tmp_path / "out", log=lambda _: None)
  weights = hf_folder.WEIGHTS_FILE
  assert (tmp_path / "out" / weights).read_bytes() == (tmp_path / "hf" / weights).read_bytes()
  assert exported == {**hf, "head_dim": 16}


def test_transformers_4_config_fields_read_alike():
  """transformers 4 writes rope_theta and rope_scaling where 5 writes rope_parameters."""
  hf = json.loads((GOLDEN / "hf_llama" / "config.json").read_text())
  old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "head_dim")}
  old.update(rope_theta=500000.0, rope_scaling=None, torch_dtype="bfloat16")
  assert hf_config.model_options(old) == hf_config.model_options(hf)
  assert hf_config.model_options(hf)["rope_base"] == 500000.0


def _edited_folder(tmp_path, name="hf_llama", edit_config=None, drop_tensor=None):
  folder = tmp_path / "hf"
  shutil.copytree(GOLDEN / name, folder)
  if edit_config:
    config = json.loads((folder / "config.json").read_text())
    edit_config(config)
    (folder / "config.json").write_text(json.dumps(config))
  if drop_tensor:
    tensors = hf_folder.read_weights(folder)
    del tensors[drop_tensor]
    hf_folder.write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
  return folder


@pytest.mark.parametrize(
  "edit_config, drop_tensor, message",
  [
    (lambda c: c.update(model_type="gpt2"), None, "model_type 'gpt2' is not supported"),
    (lambda c: c.pop("hidden_size"), None, "has no hidden_size"),
    (lambda c: c.update(intermediate_size=128), None, "'model.layers.0.mlp.gate_proj.weight' has"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3"}), None, "RoPE type 'llama3'"),
    (lambda c: c.update(hidden_act="gelu"), None, "hidden_act='gelu' is not supported"),
    (lambda c: c.update(head_dim=32), None, "head_dim=32 is not supported"),
    (lambda c: c.update(attention_bias=True), None, "attention_bias=True is not supported"),
    (None, "model.norm.weight", "no tensor 'model.norm.weight'"),
  ],
)
def test_bad_hf_folders_are_named(tmp_path, edit_config, drop_tensor, message):
  folder = _edited_folder(tmp_path, edit_config=edit_config, drop_tensor=drop_tensor)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
    convert.import_hf(folder, tmp_path / "out")
  assert not (tmp_path / "out" / "checkpoints").exists()


def test_other_bad_inputs(tmp_path):
  with pytest.raises(FileNotFoundError, match="No config.json in"):
    convert.import_hf(tmp_path, tmp_path / "out")
  (tmp_path / "weightless").mkdir()
  shutil.copy(GOLDEN / "hf_llama" / "config.json", tmp_path / "weightless")
  with pytest.raises(FileNotFoundError, match=r"No \*.safetensors file"):
    convert.import_hf(tmp_path / "weightless", tmp_path / "out")
  convert.import_hf(GOLDEN / "hf_llama", tmp_path / "done")
  with pytest.raises(ValueError, match="already holds checkpoints"):
    convert.import_hf(GOLDEN / "hf_llama", tmp_path / "done")
  text = config_lib.load_config("localtext")
  text.data.path = str(tmp_path / "corpus.txt")
  with pytest.raises(ValueError, match="has 96 ids but the model 90 token rows.*--vocab_size=96"):
    convert.import_hf(GOLDEN / "hf_llama", tmp_path / "trimmed", text, vocab_size=90)
  shutil.copytree(tmp_path / "done", tmp_path / "emptied")
  shutil.rmtree(tmp_path / "emptied" / "checkpoints")
  with pytest.raises(checkpoint.CheckpointError, match=r"--in='.*emptied': no checkpoint in"):
    convert.export_hf(tmp_path / "emptied", tmp_path / "hf")
  # A model md4jax cannot express in Llama's or Qwen2's terms.
  config = json.loads((tmp_path / "done" / "config.json").read_text())
  config["model"]["norm"] = "layer"
  (tmp_path / "done" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="model.norm='layer': Llama and Qwen2 have no equivalent"):
    convert.export_hf(tmp_path / "done", tmp_path / "hf")


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("num_kv_heads", 3, "model.num_kv_heads=3 must be 0 .* or divide model.num_heads=4"),
    ("qkv_bias", 1, "model.qkv_bias must be true or false"),
    ("rope_base", 0.0, "model.rope_base must be a float > 0"),
  ],
)
def test_model_options_are_validated(key, value, message):
  config = config_lib.base_config()
  with config.ignore_type():  # As a config file's value may be.
    config.model[key] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate_config(config, num_devices=1)


def test_tied_embeddings_need_the_full_width():
  config = config_lib.base_config()
  config.model.tie_embeddings, config.model.embed_dim = True, 16
  with pytest.raises(ValueError, match="model.tie_embeddings .* set model.embed_dim=0"):
    config_lib.validate_config(config, num_devices=1)


@pytest.mark.parametrize("num_kv_heads", [0, 1])
def test_grouped_heads_serve_the_block_samplers_cache(num_kv_heads):
  """With fewer key/value heads the cache holds [.., Hkv, Dh] (each head once, not repeated):
  two cached block calls give the logits of block diffusion's one pass."""
  model = Transformer(
    vocab_size=11,
    num_layers=2,
    model_dim=32,
    num_heads=2,
    mlp_dim=48,
    num_kv_heads=num_kv_heads,
    qkv_bias=True,
    tie_embeddings=True,
    block_size=4,
    weight_init="fan_in",
  )
  tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 8), 0, 12)
  params = model.init(jax.random.PRNGKey(1), tokens)["params"]
  params = jax.tree.map(lambda p: p + 0.1, params)  # Nonzero biases.
  whole = model.apply({"params": params}, tokens)
  kv_heads = num_kv_heads or 2
  empty = jnp.zeros((2, 3, 0, kv_heads, 16))
  cache = {"k": empty, "v": empty, "valid": jnp.zeros((0,), bool)}
  positions = jnp.broadcast_to(jnp.arange(8), (3, 8))
  first, kv = model.apply(
    {"params": params}, tokens[:, :4], positions=positions[:, :4], cache=cache
  )
  assert kv["k"].shape == kv["v"].shape == (2, 3, 4, kv_heads, 16)
  cache = {**kv, "valid": jnp.ones((4,), bool)}
  second, _ = model.apply(
    {"params": params}, tokens[:, 4:], positions=positions[:, 4:], cache=cache
  )
  np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cli_converts_then_trains_and_samples_text(tmp_path):
  """The commands docs/convert.md gives: the converted workdir trains and decodes text."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(
    "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))
  )
  workdir = tmp_path / "qwen"
  run = lambda *args: subprocess.run(
    [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  # Rows divisible by the 8 CPU devices tests/conftest.py gives every process it starts.
  data = [f"--config.data.path={corpus}", "--config.data.seq_len=32", "--config.batch_size=8"]
  result = run(
    "md4jax.convert",
    f"--in={GOLDEN / 'hf_qwen2'}",
    f"--out={workdir}",
    "--config=configs/localtext.py",
    *data,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--config=configs/workdir.py:" in result.stdout
  steps = ["--config.num_train_steps=2", "--config.optimizer.warmup_steps=1"]
  small = ["--config.eval.num_sequences=8", "--config.eval.batch_size=8"]
  small += ["--config.sample.num_samples=1", "--config.sample.trajectory=False"]
  result = run(
    "md4jax.main", f"--config=configs/workdir.py:{workdir}", f"--workdir={workdir}", *steps, *small
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Resuming from the checkpoint of step 0" in result.stdout
  sample = json.loads((workdir / "samples.jsonl").read_text().splitlines()[0])
  assert sample["step"] == 2 and isinstance(sample["text"], str) and len(sample["text"]) >= 16
  result = run("md4jax.convert", f"--in={tmp_path / 'missing'}", f"--out={tmp_path / 'x'}")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
    f"md4jax.convert: error: No config.json in {tmp_path / 'missing'}: give a Hugging Face model "
    "folder (config.json and *.safetensors, as save_pretrained writes)."
  ]
