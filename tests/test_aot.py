"""The AOT tool compiles real TPU programs on this CPU machine (libtpu's compiler, no TPU)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="the TPU compiler comes with pip install -e '.[tpu]'")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def aot(*flags) -> dict:
  result = subprocess.run(
    [sys.executable, "-m", "md4jax.aot", *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout)


@pytest.mark.slow
def test_text8_compiles_for_a_v5e_2x2_and_fits():
  report = aot("--config=configs/text8.py", "--topology=v5e:2x2")
  assert report["fits"] is True and report["device_kind"] == "TPU v5 lite" and report["chips"] == 4
  assert 0 < report["bytes_per_chip"] <= report["hbm_bytes_per_chip"] == 16 * 2**30
  breakdown = report["train_step"]["memory_breakdown"]
  assert report["bytes_per_chip"] == (
    breakdown["argument"] + breakdown["output"] + breakdown["temp"] - breakdown["alias"]
  )
  # The donated state is aliased: arguments and outputs overlap by about the state's size.
  assert breakdown["alias"] > 0.9 * breakdown["output"]
  # remat="save_dots" keeps the weight matmuls and recomputes attention; the formula leaves
  # out softmax, RoPE and norms: a little above 1, far below full remat's 4/3.
  assert 1.0 < report["flops_ratio"] < 1.2
  assert report["compile_seconds"] > 0 and report["params"] > 80e6
  at_peak = report["step_seconds_at_mfu"]
  assert at_peak["50%"] == pytest.approx(2 * at_peak["100%"])
  for step in ("eval_step", "sampler_step"):
    assert (
      report[step]["bytes_per_chip"] > 0 and report[step]["xla_cost_analysis_flops_all_chips"] > 0
    )


def test_a_config_that_does_not_fit_says_so_and_exits_zero():
  report = aot(
    "--config=configs/tiny.py",
    "--topology=v5e:2x2",
    "--config.batch_size=4194304",
    "--config.eval.batch_size=16",
  )
  assert report["fits"] is False and report["bytes_per_chip"] > report["hbm_bytes_per_chip"]
  assert "RESOURCE_EXHAUSTED" in report["compile_error"] and report["global_batch"] == 4194304


@pytest.mark.slow
def test_block_diffusion_counts_its_two_stream_forward():
  # default.py:bd3 trains on z_t ⊕ x (2L tokens): the compiled FLOPs match the 2L formula as the
  # MDM's match its L formula, and the sampler step is one block against the KV cache.
  block, plain = (
    aot(f"--config=configs/default.py{v}", "--topology=v5e:2x2") for v in (":bd3", "")
  )
  assert block["fits"] and 1.0 < block["flops_ratio"] < 1.2 and 1.0 < plain["flops_ratio"] < 1.2
  assert 2 < block["model_flops_per_step"] / plain["model_flops_per_step"] < 2.5
  assert 0 < block["sampler_step"]["bytes_per_chip"] < plain["sampler_step"]["bytes_per_chip"]


def test_a_vocabulary_left_to_the_tokenizer_is_refused_in_one_line():
  # data.vocab_size=0 (localtext's) is the tokenizer's size, which only a run reads.
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "md4jax.aot",
      "--config=localtext",
      "--config.data.path=corpus.txt",
      "--topology=v5e:2x2",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  # The last line (libtpu warns on stderr first, about the TPU it does not find here).
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
    "md4jax.aot: error: data.vocab_size=0 takes the tokenizer's size, which only a run reads: give "
    "it for the ahead-of-time check (--config.data.vocab_size=N)."
  ), result.stderr[-2000:]


# A 1-layer model of each preset's kind (MHA for LLaDA; grouped-query attention with q/k/v biases
# for Dream) on 256 tokens: compiles in seconds on any CPU machine.
TINY = (
  "--config.model.num_layers=1",
  "--config.model.model_dim=64",
  "--config.model.mlp_dim=128",
  "--config.data.vocab_size=512",
  "--config.model.checkpoint_mask_id=511",  # The released mask ids lie past a tiny vocabulary.
  "--config.data.seq_len=256",
  "--config.batch_size=4",
  "--config.eval.batch_size=4",
  "--config.sample.length=0",  # The context: Dream's preset samples 512 tokens, past 256.
)
TINY_HEADS = {
  "llada": ("--config.model.num_heads=2",),
  # Dream's shifted logits decode without a cache: its dual-cache programs price the shape only.
  "dream": ("--config.model.num_heads=4", "--config.model.num_kv_heads=2"),
}
DUAL = {"llada": (), "dream": ("--config.model.shift_logits=false", "--config.sample.cache=dual")}


@pytest.mark.parametrize(
  "name, layers, width, kv_heads, params",
  # The released checkpoints' parameter counts (LLaDA-8B's, Qwen2.5-7B's).
  [("llada", 32, 4096, 32, 8_015_581_184), ("dream", 28, 3584, 4, 7_615_616_512)],
)
def test_the_dllm_presets_have_the_released_shapes_and_validate(
  name, layers, width, kv_heads, params
):
  from md4jax import config as config_lib
  from md4jax.training import state as state_lib

  config = config_lib.load_config(name)
  config.lock()
  assert f"--config=configs/{name}.py" in (config_lib.CONFIG_DIR / f"{name}.py").read_text()
  assert config.keys() == config_lib.base_config().keys()
  m = config.model
  assert (m.num_layers, m.model_dim, m.num_kv_heads or m.num_heads) == (layers, width, kv_heads)
  assert (m.type, m.time_conditioning, config.data.seq_len) == ("mdm", "none", 4096)
  with pytest.raises(ValueError, match="data.path"):  # A run names its JSONL pairs.
    config_lib.validate_config(config, num_devices=4, platform="tpu")
  config.data.path = "pairs.jsonl"
  config_lib.validate_config(config, num_devices=4, platform="tpu")  # A v5p-8's 4 chips.
  model = state_lib.build_model(config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 128), jnp.int32), jnp.ones((1,)))
  )
  # Every released weight plus md4jax's mask row (one embedding row of width model_dim).
  assert sum(leaf.size for leaf in jax.tree.leaves(shapes)) == params + width


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.slow
def test_a_tiny_preset_reports_both_sampler_caches_and_its_train_step(name):
  flags = (f"--config=configs/{name}.py", "--topology=v5e:2x2", *TINY, *TINY_HEADS[name])
  dual = aot(*flags, *DUAL[name], "--programs=sampler,train", "--count_flops=false")
  none = aot(*flags, "--programs=sampler", "--config.sample.cache=none")
  assert dual["fits"] and none["fits"] and "eval_step" not in dual and "train_step" not in none
  assert dual["train_step"]["bytes_per_chip"] == dual["bytes_per_chip"] > 0
  assert "flops_ratio" not in dual  # --count_flops=false: no loop-free compiles.
  block, refresh, full = dual["sampler_step"], dual["sampler_refresh"], none["sampler_step"]
  assert (block["cache"], block["tokens"], refresh["tokens"]) == ("dual", 32, 256)
  assert (full["cache"], full["tokens"]) == ("none", 256)
  for program in (block, refresh, full):
    assert program["fits"] and 0 < program["bytes_per_chip"] <= dual["hbm_bytes_per_chip"]
    assert program["step_seconds_at_mfu"]["50%"] == pytest.approx(
      2 * program["step_seconds_at_mfu"]["100%"]
    )
  # A block of 32 reading 256 cached positions: about 32/256 of a full call's FLOPs.
  assert 0.1 < block["model_flops"] / full["model_flops"] < 0.2
  assert refresh["model_flops"] < full["model_flops"]  # The refresh computes no logits.


def test_a_post_training_step_compiles_with_its_rollouts_and_is_priced():
  """--programs=post_train: rollouts, estimates and update in one program, with its FLOPs: the
  sampler's calls and the estimates' (nelbo × 2 draws: β > 0's KL pair, the rollout-time one
  for 2 updates, and the 2 updates forward and backward)."""
  report = aot(
    "--config=configs/tiny.py",
    "--topology=v5e:2x2",
    "--programs=post_train",
    "--config.post_train.group_size=4",
    "--config.post_train.likelihood_draws=2",
    "--config.post_train.updates_per_rollout=2",
    "--config.post_train.beta=0.1",
  )
  step = report["post_train_step"]
  assert report["fits"] is True and step["fits"] is True and step["bytes_per_chip"] > 0
  assert step["prompts"] == 16 and step["rollouts"] == 64 and step["sampler_calls"] == 8
  per_call = step["model_flops"] / (8 + (2 + 1 + 3 * 2) * 2)
  assert per_call == pytest.approx(report["model_flops_per_step"] / 3 * 64 / 16)
  assert step["step_seconds_at_mfu"]["50%"] == pytest.approx(
    2 * step["step_seconds_at_mfu"]["100%"]
  )
