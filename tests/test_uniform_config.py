"""diffusion.process="uniform" from the CLI: configs/default.py:uniform trains, evaluates and
samples; the masked process's options are one-line config errors."""

import json
import pathlib
import subprocess
import sys

import pytest

import md4jax
from md4jax import config as config_lib
from md4jax.app import post_train

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(module: str, *flags, variant="uniform") -> subprocess.CompletedProcess:
  """python -m module --config=configs/default.py:VARIANT *flags, which must succeed."""
  result = subprocess.run(
    [sys.executable, "-m", module, f"--config=configs/default.py:{variant}", *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_the_uniform_default_trains_evaluates_and_samples(tmp_path):
  result = _run(
    "md4jax.main",
    f"--workdir={tmp_path}",
    "--config.num_train_steps=30",
    "--config.optimizer.warmup_steps=5",
    "--config.eval_every_steps=30",
    "--config.eval.num_sequences=64",
    "--config.eval.num_mc_samples=2",
    "--config.eval.discrete_steps=8",
    "--config.sample.num_steps=8",
  )
  assert "exact entropy" in result.stdout and "standard" in result.stdout
  evaluation = json.loads((tmp_path / "eval.json").read_text())
  assert evaluation["estimator"] == "standard" and set(evaluation["discrete_time"]) == {"8"}
  samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert samples and all(len(record["tokens"]) == 64 for record in samples)
  assert not (tmp_path / "trajectory.html").exists()  # A masked process's picture.
  loaded = md4jax.load(tmp_path)
  assert (loaded.process, loaded.mask_id) == ("uniform", None)


@pytest.mark.slow
def test_block_diffusion_under_uniform_noise_trains_evaluates_and_samples(tmp_path):
  """Blocks of 16: trained in the two-stream pass, the discrete bound on the reference path, and
  sampled block after block through the exact KV cache."""
  result = _run(
    "md4jax.main",
    f"--workdir={tmp_path}",
    "--config.diffusion.block_size=16",
    "--config.num_train_steps=10",
    "--config.optimizer.warmup_steps=2",
    "--config.eval_every_steps=10",
    "--config.eval.num_sequences=32",
    "--config.eval.num_mc_samples=2",
    "--config.eval.discrete_steps=4",
    "--config.sample.num_steps=4",
    "--config.sample.num_samples=4",
  )
  assert "exact entropy" in result.stdout
  evaluation = json.loads((tmp_path / "eval.json").read_text())
  # Ten steps in, the continuous bound is far above the 4-step one (its small-t terms punish an
  # untrained network's doubt about clean tokens); both are finite bounds above the entropy.
  entropy = evaluation["true_bits_per_token"]
  assert entropy < evaluation["nelbo_bits_per_token"] < 100
  assert entropy < evaluation["discrete_time"]["4"]["bits_per_token"] < 100
  samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert len(samples) == 4 and all(len(record["tokens"]) == 64 for record in samples)
  assert all(record["nfe"] == 4 * 4 for record in samples)  # 4 blocks of 4 steps.


def _uniform(**overrides):
  config = config_lib.load_config("default:uniform")
  for key, value in overrides.items():
    section, leaf = key.split("__")
    config[section][leaf] = value
  return config


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(diffusion__process="absorbing"), "diffusion.process"),
    (dict(sample__method="confidence"), r"sample.method='confidence': diffusion.process='uniform'"),
    (dict(training__estimator="forced_target"), r"training.estimator='forced_target'"),
    (dict(eval__estimator="mask_count"), r"eval.estimator='mask_count'"),
    (dict(diffusion__block_size=16, model__self_condition=True), "diffusion.block_size=0"),
    (dict(diffusion__block_size=24), "diffusion.block_size=24 must be 0 or divide"),
    (dict(diffusion__schedule="learned_poly", model__time_conditioning="adaln"), "learned"),
    (dict(model__time_input="t"), r"model.time_input='t'"),
    (dict(sample__cache="prefix"), r"sample.cache='prefix'"),
    (dict(frontier__methods="ancestral,confidence"), "frontier.methods"),
    (dict(training__prompt_dropout=0.1), "training.prompt_dropout"),
    (dict(model__time_conditioning="none"), "depends on the noise level"),
    (dict(sample__temperature=-1.0), "sample.temperature must be >= 0"),
    (dict(sample__top_p=1.5), r"sample.top_p must be in \(0, 1\]"),
  ],
)
def test_options_of_the_masked_process_are_one_line_errors(overrides, match):
  with pytest.raises(ValueError, match=match) as error:
    config_lib.validate_config(_uniform(**overrides), num_devices=1)
  assert "\n" not in str(error.value)


def test_its_own_samplers_validate_in_the_frontier():
  config_lib.validate_config(
    _uniform(frontier__methods="ancestral,greedy_tail,canvas", sample__method="canvas"),
    num_devices=1,
  )


def test_post_training_a_uniform_model_is_refused():
  config = _uniform()
  config.post_train.init_from = "/some/workdir"
  with pytest.raises(ValueError, match="diffusion.process='uniform' is not supported"):
    post_train.check_run(config)


@pytest.mark.parametrize(
  "variant, cache",
  [pytest.param("uniform", "none", marks=pytest.mark.slow), ("uniform_bd3", "exact")],
)
def test_the_uniform_default_compiles_for_a_tpu(variant, cache):
  """md4jax.aot: its train step (the uniform bound; in blocks, the two-stream pass with adaLN per
  position) and a sampler step (in blocks, a block's call on the exact cache), on a v5e 2x2."""
  pytest.importorskip("libtpu", reason="the TPU compiler comes with pip install -e '.[tpu]'")
  result = _run(
    "md4jax.aot",
    "--topology=v5e:2x2",
    "--programs=sampler,train",
    "--count_flops=false",
    variant=variant,
  )
  report = json.loads(result.stdout)
  assert report["fits"] and report["train_step"]["bytes_per_chip"] > 0
  assert report["sampler_step"]["fits"] and report["sampler_step"]["cache"] == cache
