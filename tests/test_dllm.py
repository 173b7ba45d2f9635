"""The released diffusion LMs, LLaDA and Dream: converted (md4jax.convert), against their own code.

The golden folders (tests/golden/make_dllm_golden.py, run with their modeling code, torch and
transformers, which this test does not need) hold tiny random models of each: LLaDA's OLMo-named
bidirectional blocks in float32, Dream's Qwen2 blocks with biases and shifted logits in bfloat16,
each with its own mask id (126) inside a 128-token vocabulary, a tokenizer and a chat template,
and the outputs of their code: logits, generations and LLaDA's Monte-Carlo likelihood.

md4jax never predicts the mask (its logit is −inf); their code can. The golden generations and
likelihoods were taken with the mask's logit removed as well, so they compare like with like; the
raw logits are compared on every other column.
"""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax import convert
from md4jax.app import hf as hf_lib
from md4jax.app import load
from md4jax.data import chat
from md4jax.model import hf_config, hf_folder, hf_tensors
from md4jax.training import checkpoint

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
MODELS = ("llada", "dream")


def converted(tmp_path, name):
  """md4jax.load of the golden folder converted into a workdir."""
  convert.import_hf(GOLDEN / name, tmp_path / name)
  return load.load(tmp_path / name)


@pytest.mark.parametrize("name", MODELS)
def test_converted_logits_equal_their_code(tmp_path, name):
  loaded = converted(tmp_path, name)
  config = loaded.config
  vocab, mask_id = config.data.vocab_size, config.model.checkpoint_mask_id
  assert (vocab, mask_id, config.model.type) == (128, 126, "mdm")
  assert config.model.shift_logits == (name == "dream")
  golden = np.load(GOLDEN / name / "logits.npz")
  ids = golden["token_ids"]
  assert (ids == mask_id).any()  # Their mask id is md4jax's mask input V.
  z = jnp.asarray(np.where(ids == mask_id, vocab, ids))
  logits = np.asarray(loaded.model.apply({"params": loaded.params}, z))
  expected = golden["logits"]
  if name == "dream":  # Dream's generation reads position i's logits at i − 1.
    expected = np.concatenate([expected[:, :1], expected[:, :-1]], axis=1)
  others = np.arange(vocab) != mask_id
  # Measured: 2.5e-6 (LLaDA) and 1.9e-6 (Dream) of logits up to 2.9.
  scale = np.abs(expected).max()
  np.testing.assert_allclose(logits[..., others], expected[..., others], atol=1e-5 * scale)
  assert np.all(logits[..., mask_id] == -np.inf)


@pytest.mark.parametrize("name", MODELS)
def test_export_writes_their_folder_back(tmp_path, name):
  convert.import_hf(GOLDEN / name, tmp_path / "workdir")
  hf = convert.export_hf(tmp_path / "workdir", tmp_path / "out", log=lambda _: None)
  original = hf_folder.read_weights(GOLDEN / name)
  written = hf_folder.read_weights(tmp_path / "out")
  assert sorted(written) == sorted(original)
  for tensor in original:
    assert written[tensor].dtype == original[tensor].dtype
    np.testing.assert_array_equal(written[tensor], original[tensor], err_msg=tensor)
  saved = json.loads((GOLDEN / name / "config.json").read_text())
  assert {k: v for k, v in hf.items() if k in saved} == saved
  for kept in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (tmp_path / "out" / kept).read_bytes() == (GOLDEN / name / kept).read_bytes()


def test_the_trained_mask_row_is_exported_at_the_mask_id(tmp_path):
  """Fine-tuning moves md4jax's mask input (row V); export writes it to the checkpoint's id."""
  options = hf_config.model_options(hf_folder.read_config(GOLDEN / "llada"))
  tensors = hf_folder.read_weights(GOLDEN / "llada")
  params = hf_tensors.to_md4jax(dict(tensors), options, model_type="llada")
  embedding = params["embed"]["embedding"]
  np.testing.assert_array_equal(embedding[-1], embedding[126])
  embedding[-1] += 1.0
  back = hf_tensors.from_md4jax(params, options, np.float32, "llada")
  exported = back["model.transformer.wte.weight"]
  np.testing.assert_array_equal(exported[126], embedding[-1])
  np.testing.assert_array_equal(exported[:126], tensors["model.transformer.wte.weight"][:126])


def _copy(name, tmp_path) -> pathlib.Path:
  folder = tmp_path / f"bad_{name}"
  shutil.copytree(GOLDEN / name, folder)
  return folder


def _missing_shard(tmp_path):
  folder = _copy("llada", tmp_path)
  index = {"metadata": {}, "weight_map": {"model.transformer.wte.weight": "model.safetensors"}}
  index["weight_map"]["model.transformer.ln_f.weight"] = "model-00002-of-00002.safetensors"
  (folder / hf_folder.INDEX_FILE).write_text(json.dumps(index))
  return folder


def _wrong_mask_id(tmp_path):
  folder = _copy("llada", tmp_path)
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": 125}))
  return folder


def _no_tokenizer(tmp_path):
  folder = _copy("dream", tmp_path)
  (folder / "tokenizer.json").unlink()
  return folder


def _gpt2(tmp_path):
  folder = _copy("dream", tmp_path)
  (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
  return folder


@pytest.mark.parametrize(
  "make, message",
  [
    (_missing_shard, "lists 1 shard(s) that are not there: model-00002-of-00002.safetensors"),
    (_wrong_mask_id, "mask_token_id is 125, but its tokenizer has <|mdm_mask|> at id 126"),
    (_no_tokenizer, "has no tokenizer.json: a Dream folder needs its tokenizer"),
    (_gpt2, "model_type 'gpt2' is not supported; md4jax converts llama, qwen2, llada, Dream"),
  ],
)
def test_bad_folders_are_named_and_nothing_is_written(tmp_path, make, message):
  folder = make(tmp_path)
  out = tmp_path / "out"
  with pytest.raises((ValueError, FileNotFoundError)) as raised:
    convert.import_hf(folder, out)
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert not out.exists() or not any(out.rglob("*"))


def test_a_dllm_is_a_masked_diffusion_model_only():
  with pytest.raises(ValueError, match="must be 'mdm', not 'ar'"):
    hf_lib.folder_config(GOLDEN / "llada", model_type="ar")


@pytest.mark.parametrize(
  "name, expected",
  [
    (
      "llada",
      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    ("dream", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
  ],
)
def test_chat_template_renders_a_user_turn(name, expected):
  config, _ = hf_lib.folder_config(GOLDEN / name)
  text = chat.apply(config.data.chat_template, "Hi")
  assert text.endswith(expected)
  tokenizer = hf_lib.tokenizer_lib.load(GOLDEN / name / "tokenizer.json")
  assert tokenizer.decode(tokenizer.encode(text)) == text  # Special tokens are one id each.


def test_chat_needs_a_template():
  config = config_lib.base_config()
  config.sample.chat = True
  with pytest.raises(ValueError, match="data.chat_template, which is empty"):
    config_lib.validate_config(config, 1, "cpu")


@pytest.mark.parametrize("suppressed", [True, False])
def test_lladas_monte_carlo_likelihood_is_the_mask_count_nelbo(tmp_path, suppressed):
  """LLaDA's get_log_likelihood draws k ~ U{1..n} answer positions to mask and weighs their
  cross-entropy by n / k: md4jax's mask_count estimator. Replayed on its own draws (their masks,
  λ = k / n), md4jax's NELBO draws equal its losses; with the mask's logit kept (a network
  without checkpoint_mask_id, as LLaDA's code scores), and with it removed (as md4jax scores)."""
  from md4jax import nelbo  # pylint: disable=g-import-not-at-top
  from md4jax.diffusion import schedules  # pylint: disable=g-import-not-at-top

  loaded = converted(tmp_path, "llada")
  golden = np.load(GOLDEN / "llada" / "likelihood.npz")
  model = loaded.model if suppressed else loaded.model.clone(checkpoint_mask_id=-1)
  vocab = loaded.config.data.vocab_size
  x = np.concatenate([golden["prompt"], golden["answer"]])[None].repeat(len(golden["masks"]), 0)
  editable = np.arange(x.shape[1]) >= len(golden["prompt"])
  per_draw = nelbo(
    jnp.zeros((2,), jnp.uint32),
    lambda z, alpha: model.apply({"params": loaded.params}, z),
    jnp.asarray(x),
    schedules.get_schedule("linear"),
    mask_id=vocab,
    editable=jnp.asarray(np.broadcast_to(editable, x.shape)),
    estimator="mask_count",
    draws={"t": jnp.asarray(golden["p_mask"]), "masked": jnp.asarray(golden["masks"])},
  )
  per_draw = np.asarray(per_draw)
  suffix = "" if suppressed else "_raw"
  batches = per_draw.reshape(-1, int(golden["batch_size"])).mean(1)  # Their loss per batch.
  np.testing.assert_allclose(batches, golden["losses" + suffix], rtol=2e-5)
  np.testing.assert_allclose(-per_draw.mean(), golden["log_likelihood" + suffix], rtol=2e-5)


def _their_tokens(ids, mask_id, vocab):
  """Their ids with their mask id as md4jax's (V)."""
  return np.where(ids == mask_id, vocab, ids)


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
  """{name: md4jax.load of the converted golden folder}, converted once for the module."""
  root = tmp_path_factory.mktemp("dllm")
  return {name: converted(root, name) for name in MODELS}


@pytest.mark.parametrize("case", range(5))
def test_lladas_generate_token_for_token(golden_models, case):
  """LLaDA's generate at temperature 0 (low-confidence remasking, semi-autoregressive blocks
  after the prompt, steps split evenly with the remainder first, classifier-free guidance) is
  method="confidence" with reveal_counts="even" in blocks from the prompt's end."""
  loaded = golden_models["llada"]
  golden = np.load(GOLDEN / "llada" / "generate.npz")
  get = lambda field: golden[f"c{case}_{field}"]
  assert str(get("remasking")) == "low_confidence" and float(get("temperature")) == 0.0
  prompt = get("prompt")
  gen_length, block_length = int(get("gen_length")), int(get("block_length"))
  num_blocks = gen_length // block_length
  vocab = loaded.config.data.vocab_size
  tokens, info = md4jax_sample(
    loaded,
    batch_size=prompt.shape[0],
    length=prompt.shape[1] + gen_length,
    method="confidence",
    num_steps=int(get("steps")) // num_blocks,
    temperature=0.0,
    prompt=jnp.asarray(prompt),
    block_size=block_length,
    block_offset=prompt.shape[1],
    reveal_counts="even",
    guidance_scale=float(get("cfg_scale")),
  )
  np.testing.assert_array_equal(np.asarray(tokens), _their_tokens(get("output"), 126, vocab))
  assert int(info["num_blocks"]) == num_blocks


@pytest.mark.parametrize("case", range(7))
def test_dreams_diffusion_generate_token_for_token(golden_models, case):
  """Dream's diffusion_generate at temperature 0 (maskgit_plus, topk_margin, entropy; top_p) is
  method="confidence" with confidence max_prob, margin, neg_entropy and reveal_counts
  "proportional", over the whole canvas."""
  loaded = golden_models["dream"]
  golden = np.load(GOLDEN / "dream" / "generate.npz")
  get = lambda field: golden[f"c{case}_{field}"]
  confidence = {"maskgit_plus": "max_prob", "topk_margin": "margin", "entropy": "neg_entropy"}
  prompt = get("prompt")
  top_p = float(get("top_p"))
  tokens, _ = md4jax_sample(
    loaded,
    batch_size=prompt.shape[0],
    length=prompt.shape[1] + int(get("max_new_tokens")),
    method="confidence",
    confidence=confidence[str(get("alg"))],
    num_steps=int(get("steps")),
    temperature=0.0,
    top_p=top_p if top_p < 1 else None,
    prompt=jnp.asarray(prompt),
    reveal_counts="proportional",
  )
  vocab = loaded.config.data.vocab_size
  np.testing.assert_array_equal(np.asarray(tokens), _their_tokens(get("output"), 126, vocab))


def md4jax_sample(loaded, **kwargs):
  """md4jax.sample with the loaded model's denoiser, schedule and mask id."""
  import md4jax  # pylint: disable=g-import-not-at-top

  return md4jax.sample(
    jax.random.PRNGKey(0),
    loaded.denoise_fn,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    **kwargs,
  )


# Their decoding as config.sample keys: LLaDA's blocks after the prompt, Dream's whole canvas.
THEIR_DECODING = {
  "llada": (
    "--config.sample.reveal_counts=even",
    "--config.sample.blocks_after_prompt=true",
    "--config.sample.block_length=2",
  ),
  "dream": ("--config.sample.reveal_counts=proportional", "--config.sample.confidence=margin"),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_cli_converts_then_fine_tunes_and_chats(tmp_path, name):
  """docs/convert.md's walk-through on the golden folder: convert onto prompt/response pairs, SFT
  (only responses masked) resuming from step 0, evaluate, and sample a chat turn."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text(
    "".join(json.dumps({"prompt": f"{i}+{i}=", "response": str(2 * i)}) + "\n" for i in range(80))
  )
  workdir = tmp_path / name
  run = lambda *args: subprocess.run(
    [sys.executable, "-m", *args],
    cwd=GOLDEN.parent.parent,
    capture_output=True,
    text=True,
    timeout=300,
  )
  result = run(
    "md4jax.convert",
    f"--in={GOLDEN / name}",
    f"--out={workdir}",
    "--config=configs/conditional.py",
    f"--config.data.path={pairs}",
    "--config.data.seq_len=32",
    "--config.batch_size=8",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  result = run(
    "md4jax.main",
    f"--config=configs/workdir.py:{workdir}",
    f"--workdir={workdir}",
    "--config.num_train_steps=2",
    "--config.optimizer.warmup_steps=1",
    "--config.eval.num_sequences=8",
    "--config.eval.batch_size=8",
    "--config.sample.num_samples=1",
    "--config.sample.trajectory=False",
    "--config.sample.chat=true",
    "--config.sample.prompt=7+7=",
    "--config.sample.method=confidence",
    "--config.sample.temperature=0",
    "--config.sample.num_steps=4",
    *THEIR_DECODING[name],
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Resuming from the checkpoint of step 0" in result.stdout
  assert "NELBO" in result.stdout
  sample = json.loads((workdir / "samples.jsonl").read_text().splitlines()[0])
  turn = {"llada": "<|start_header_id|>user<|end_header_id|>", "dream": "<|im_start|>user"}[name]
  assert sample["step"] == 2 and sample["text"].startswith(turn)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_compute_stays_within_its_rounding(golden_models, name):
  """model.dtype=bfloat16 (the TPU presets' compute): their float32 logits within a few bfloat16
  roundings (2^-8 relative each) of the logits' scale; measured 1.2% (LLaDA) and 1.4% (Dream)."""
  loaded = golden_models[name]
  golden = np.load(GOLDEN / name / "logits.npz")
  vocab, mask_id = loaded.config.data.vocab_size, loaded.config.model.checkpoint_mask_id
  z = jnp.asarray(_their_tokens(golden["token_ids"], mask_id, vocab))
  model = loaded.model.clone(dtype=jnp.bfloat16)
  logits = np.asarray(model.apply({"params": loaded.params}, z)).astype(np.float32)
  assert model.apply({"params": loaded.params}, z).dtype == jnp.bfloat16
  expected = golden["logits"]
  if name == "dream":
    expected = np.concatenate([expected[:, :1], expected[:, :-1]], axis=1)
  others = np.arange(vocab) != mask_id
  scale = np.abs(expected).max()
  np.testing.assert_allclose(logits[..., others], expected[..., others], atol=8 * 2**-8 * scale)


def test_a_fine_tuned_workdir_exports_as_the_folder_it_started_from(tmp_path):
  """A run started from a converted workdir (training.init_from: SFT or LoRA) has no Hugging Face
  config of its own: export follows init_from to it, and writes its architecture and files."""
  from md4jax.training import state as state_lib  # pylint: disable=g-import-not-at-top

  convert.import_hf(GOLDEN / "llada", tmp_path / "converted")
  loaded = load.load(tmp_path / "converted")
  config = loaded.config.copy_and_resolve_references()
  config.training.init_from = str(tmp_path / "converted")
  config.model.lora_rank, config.model.lora_alpha = 4, 8.0
  tuned = tmp_path / "tuned"
  tuned.mkdir()
  (tuned / "config.json").write_text(config.to_json_best_effort(indent=2))
  params = state_lib.starting_params(config, loaded.params, loaded.config)
  state = state_lib.state_from_params(config, state_lib.make_optimizer(config), params)
  manager = checkpoint.make_manager(tuned / "checkpoints", 1)
  checkpoint.save(manager, 1, state, {"next_batch_index": 0}, config)
  checkpoint.wait(manager)
  hf = convert.export_hf(tuned, tmp_path / "out", log=lambda _: None)
  assert hf["model_type"] == "llada" and hf["mask_token_id"] == 126
  for kept in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "out" / kept).read_bytes() == (GOLDEN / "llada" / kept).read_bytes()
  # Fresh adapters are zero in B: the merged export is the converted model itself.
  original = hf_folder.read_weights(GOLDEN / "llada")
  written = hf_folder.read_weights(tmp_path / "out")
  for tensor in original:
    np.testing.assert_array_equal(written[tensor], original[tensor], err_msg=tensor)


def test_blocks_after_the_prompt_need_every_position_before_them_given(golden_models):
  loaded = golden_models["llada"]
  prompt = jnp.asarray([[1, 2, loaded.mask_id, 3]], jnp.int32)
  with pytest.raises(ValueError, match="leaves positions before it masked"):
    md4jax_sample(
      loaded, batch_size=1, length=8, prompt=prompt, block_size=2, block_offset=4, num_steps=2
    )


def test_blocks_after_the_prompt_must_tile_the_rest(golden_models):
  """As LLaDA's generate asserts: the tokens after the prompt are whole blocks."""
  from md4jax.app import generate  # pylint: disable=g-import-not-at-top

  loaded = golden_models["llada"]
  config = loaded.config.copy_and_resolve_references()
  config.sample.update(prompt="12 34 56 7 8 9", length=16, block_length=4, blocks_after_prompt=True)
  config.sample.update(method="confidence", num_samples=1, num_steps=2, trajectory=False)
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="the 10 tokens after the 6-token prompt are no whole"):
    generate.generate(config, loaded.model, loaded.params, loaded.tokenizer, key)
  config.sample.length = 14
  tokens, nfe, _, _ = generate.generate(config, loaded.model, loaded.params, loaded.tokenizer, key)
  assert tokens.shape == (1, 14) and nfe == 4  # Two blocks of two steps.


def test_lladas_dual_cache_blocks_follow_a_prompt_of_any_width(golden_models):
  """configs/llada.py's decoding (the dual cache, blocks after the prompt) of a prompt whose width
  is no multiple of the block: validation passes, and the blocks tile the length after it."""
  from md4jax.app import generate  # pylint: disable=g-import-not-at-top

  loaded = golden_models["llada"]
  config = loaded.config.copy_and_resolve_references()
  config.sample.update(prompt="12 34 56 7 8 9", length=14, block_length=4, blocks_after_prompt=True)
  config.sample.update(method="confidence", num_samples=2, num_steps=2, trajectory=False)
  config.sample.update(cache="dual", temperature=0.0, reveal_counts="even")
  config_lib.validate_config(config, num_devices=1)
  key = jax.random.PRNGKey(0)
  tokens, nfe, _, _ = generate.generate(config, loaded.model, loaded.params, loaded.tokenizer, key)
  prompt = generate.encode_prompt(config, loaded.tokenizer)
  assert len(prompt) == 6 and tokens.shape == (2, 14)
  assert nfe == 6  # Two blocks [6, 10), [10, 14): a refresh and two steps each.
  np.testing.assert_array_equal(tokens[:, :6], np.stack([prompt] * 2))
  assert (tokens < loaded.config.data.vocab_size).all()
  expected, _ = md4jax_sample(
    loaded,
    batch_size=2,
    length=14,
    method="confidence",
    reveal_counts="even",
    num_steps=2,
    temperature=0.0,
    prompt=jnp.asarray(prompt),
    block_size=4,
    block_offset=6,
    cache="dual",
  )
  np.testing.assert_array_equal(tokens, np.asarray(expected))


def test_lm_evals_generation_refuses_blocks_after_the_prompt(golden_models):
  """generate_until samples every context length in one program: LLaDA's blocks after each
  prompt are refused in one line, as sample.cache is."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from md4jax.app import harness_generate, harness_model  # pylint: disable=g-import-not-at-top

  loaded = golden_models["llada"]
  config = loaded.config.copy_and_resolve_references()
  config.sample.update(blocks_after_prompt=True, block_length=4)
  with pytest.raises(harness_model.HarnessError, match="sample.blocks_after_prompt") as raised:
    harness_generate.Generator(dataclasses.replace(loaded, config=config), 0)
  assert "\n" not in str(raised.value)
  harness_generate.Generator(loaded, 0)
