"""The CLI end to end (subprocesses): train -> eval -> sample, resume after SIGKILL, bad flags."""

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXT8_DEV = ROOT.parent / "shared" / "data" / "wiki_text8_dev.txt"


def cli(workdir, *flags, config="configs/tiny.py"):
  return [sys.executable, "-m", "md4jax.main", f"--config={config}", f"--workdir={workdir}", *flags]


def run_cli(workdir, *flags, config="configs/tiny.py", check=True):
  result = subprocess.run(
    cli(workdir, *flags, config=config), cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def read_jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_eval_sample(tmp_path):
  # With the host allocator setting configs/default.py uses (md4jax.runtime.allocator).
  result = run_cli(
    tmp_path,
    "--config.num_train_steps=10",
    "--config.eval_every_steps=5",
    "--config.checkpoint_every_steps=5",
    "--config.reuse_freed_host_memory=True",
  )
  assert "tokens/s" in result.stdout and "ETA" in result.stdout
  assert "exact entropy" in result.stdout and "gap" in result.stdout
  split = re.search(
    r"Wall time (\d+)s: setup ([\d.]+)s, training ([\d.]+)s, final evaluation "
    r"([\d.]+)s, sampling ([\d.]+)s",
    result.stdout,
  )
  assert split, result.stdout[-2000:]
  assert abs(float(split[1]) - sum(map(float, split.groups()[1:]))) <= 2  # The parts add up.
  assert json.loads((tmp_path / "config.json").read_text())["num_train_steps"] == 10
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [5, 10]
  for record in records:
    assert {
      "step",
      "loss",
      "nelbo_bits_per_token",
      "learning_rate",
      "tokens_per_second",
      "grad_norm",
    } <= record.keys()
    assert np.isfinite(record["loss"])
  evaluation = json.loads((tmp_path / "eval.json").read_text())
  assert evaluation["step"] == 10
  assert {
    "nelbo_bits_per_token",
    "nelbo_bits_per_token_stderr",
    "true_bits_per_token",
    "gap_percent",
  } <= evaluation.keys()
  assert 0 < evaluation["nelbo_bits_per_token_stderr"] < 0.5
  # Discrete-T bounds tighten with T and sit above the continuous one, within 3 SE.
  table = evaluation["discrete_time"]
  chain = [table[t] for t in ("10", "50", "1000")] + [
    {
      "bits_per_token": evaluation["nelbo_bits_per_token"],
      "stderr": evaluation["nelbo_bits_per_token_stderr"],
    }
  ]
  for looser, tighter in zip(chain, chain[1:]):
    slack = 3 * math.hypot(looser["stderr"], tighter["stderr"])
    assert looser["bits_per_token"] >= tighter["bits_per_token"] - slack, table
  estimators = evaluation["estimators"]
  assert estimators["mask_count"]["stderr"] < estimators["standard"]["stderr"]
  report = (tmp_path / "eval.md").read_text()
  assert (
    f"≤ {evaluation['nelbo_bits_per_token']:.4f} ± {evaluation['nelbo_bits_per_token_stderr']:.4f}"
    in report
  )
  assert "true entropy" in report and "| 1000 |" in report
  assert (
    "## Per-t loss profile" in report and len(evaluation["loss_profile"]["bits_per_token"]) == 20
  )
  for name in ("training_curves.png", "nelbo_vs_steps.png", "loss_profile.png"):
    assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
  samples = read_jsonl(tmp_path / "samples.jsonl")
  assert len(samples) == 2 and all(len(s["tokens"]) == 16 for s in samples)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "5"]
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

  (tmp_path / "eval.json").unlink()
  result = run_cli(tmp_path, "--mode=eval")
  assert "NELBO" in result.stdout
  assert json.loads((tmp_path / "eval.json").read_text())["nelbo_bits_per_token"] == pytest.approx(
    evaluation["nelbo_bits_per_token"], rel=1e-6
  )  # Same EMA params, same evaluation keys.

  (tmp_path / "samples.jsonl").unlink()
  run_cli(tmp_path, "--mode=sample", "--config.sample.num_samples=3")
  samples = read_jsonl(tmp_path / "samples.jsonl")
  assert len(samples) == 3 and all(0 <= t < 8 for s in samples for t in s["tokens"])
  assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2  # eval/sample leave metrics alone.
  for sample in samples:
    assert {"text", "nfe", "seconds", "method", "num_steps", "temperature"} <= sample.keys()
    assert sample["nfe"] == 8 and sample["seconds"] > 0  # tiny: 8 ancestral steps.
  page = (tmp_path / "trajectory.html").read_text()
  assert 'type="range"' in page and "http" not in page
  assert (tmp_path / "trajectory.gif").read_bytes()[:6] in (b"GIF87a", b"GIF89a")

  # Prompted, top-k, first-hitting, 40 tokens past the 16-token context (block by block).
  run_cli(
    tmp_path,
    "--mode=sample",
    "--config.sample.prompt=1 2 3",
    "--config.sample.length=40",
    "--config.sample.method=first_hitting",
    "--config.sample.top_k=3",
  )
  samples = read_jsonl(tmp_path / "samples.jsonl")
  for sample in samples:
    assert len(sample["tokens"]) == 40 and sample["tokens"][:3] == [1, 2, 3]
    assert sample["text"].startswith("1 2 3 ") and sample["top_k"] == 3
    assert sample["nfe"] == 13 + 3 * 8  # 13 masks in the first window, then 3 blocks of 8.
  # Classifier-free guidance through Fast-dLLM's dual cache, block by block.
  run_cli(
    tmp_path,
    "--mode=sample",
    "--config.sample.prompt=1 2 3",
    "--config.sample.cache=dual",
    "--config.sample.block_length=4",
    "--config.sample.guidance_scale=1.0",
  )
  for sample in read_jsonl(tmp_path / "samples.jsonl"):
    assert sample["tokens"][:3] == [1, 2, 3] and sample["guidance_scale"] == 1.0
    # 4 blocks: 8 steps and a refresh each.
    assert sample["cache"] == "dual" and sample["nfe"] == 4 * 8 + 4
  result = run_cli(tmp_path, "--mode=sample", "--config.sample.prompt=1 99", check=False)
  assert result.returncode != 0 and "Prompt ids must be in [0, 8)" in result.stderr


@pytest.mark.slow
def test_many_steps_between_logs_on_a_cpu_mesh(tmp_path):
  # 400 fast steps without a sync once queued dozens of steps, and XLA:CPU's all-reduce
  # between the 8 devices deadlocked (aborting the run after 40 s): train.MAX_STEPS_IN_FLIGHT.
  result = run_cli(
    tmp_path,
    "--config.cpu_devices=8",
    "--config.num_train_steps=400",
    "--config.log_every_steps=400",
    "--config.eval_every_steps=400",
    "--config.checkpoint_every_steps=400",
    "--config.eval.discrete_steps=",
    "--config.eval.profile_bins=0",
    "--config.sample.num_samples=0",
  )
  assert "Training on 8 cpu device(s): data=8, fsdp=1, tensor=1." in result.stdout
  assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [400]


@pytest.mark.slow
def test_ar_twin_judges_diffusion_samples(tmp_path):
  judge, model = tmp_path / "ar", tmp_path / "mdm"
  run_cli(
    judge,
    "--config.num_train_steps=10",
    "--config.sample.num_samples=0",
    config="configs/tiny_ar.py",
  )
  ar_eval = json.loads((judge / "eval.json").read_text())
  assert ar_eval["estimator"] == "exact_nll" and "discrete_time" not in ar_eval
  assert "exact NLL (bits/token)" in (judge / "eval.md").read_text()
  run_cli(model, "--config.num_train_steps=10", "--config.sample.num_samples=0")
  run_cli(
    model,
    "--mode=eval",
    f"--config.eval.judge_workdir={judge}",
    "--config.eval.num_judged_samples=8",
  )
  evaluation = json.loads((model / "eval.json").read_text())
  assert evaluation["num_judged_samples"] == 8 and evaluation["generative_perplexity"] > 1
  assert 0 < evaluation["sample_entropy"] <= 3  # At most log2(8) bits of 8 ids.
  assert evaluation["sampler"]["method"] == "ancestral" and evaluation["sampler"]["num_steps"] == 8
  assert "generative perplexity" in (model / "eval.md").read_text()
  pair = evaluation["side_by_side"]
  assert pair["judge_nll_bits_per_token"] == pytest.approx(ar_eval["nll_bits_per_token"], rel=1e-5)
  assert "Side by side with the AR judge" in (model / "eval.md").read_text()

  result = run_cli(
    model,
    "--mode=frontier",
    f"--config.eval.judge_workdir={judge}",
    "--config.frontier.num_steps=4",
    "--config.frontier.temperatures=0.8,1",
    "--config.frontier.num_samples=8",
  )
  sweep = json.loads((model / "frontier.json").read_text())
  assert [(p["method"], p["temperature"]) for p in sweep["points"]] == [
    ("ancestral", 0.8),
    ("ancestral", 1.0),
    ("confidence", 0.8),
    ("confidence", 1.0),
  ]
  for point in sweep["points"]:
    assert point["generative_perplexity"] > 1 and point["nfe"] == 4 and "true_perplexity" in point
  assert sweep["data"]["num_rows"] == 8 and sweep["judge_workdir"] == str(judge)
  assert (model / "plots" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
  assert "frontier.json" in result.stdout


def test_config_typo_fails(tmp_path):
  result = run_cli(tmp_path, "--config.num_train_step=5", check=False)
  assert result.returncode != 0 and "num_train_step" in result.stderr


@pytest.mark.slow
def test_invalid_value_fails_before_training(tmp_path):
  result = run_cli(tmp_path, "--config.diffusion.schedule=cosyne", check=False)
  assert result.returncode != 0 and "Unknown schedule 'cosyne'" in result.stderr
  assert not (tmp_path / "checkpoints").exists()


def test_eval_without_checkpoint_fails(tmp_path):
  result = run_cli(tmp_path, "--mode=eval", check=False)
  assert result.returncode != 0 and "No checkpoint in" in result.stderr


@pytest.mark.skipif(not TEXT8_DEV.is_file(), reason=f"text8 dev file not found at {TEXT8_DEV}")
@pytest.mark.slow
def test_text8_smoke(tmp_path):
  run_cli(
    tmp_path,
    f"--config.data.path={TEXT8_DEV}",
    "--config.batch_size=8",
    "--config.data.seq_len=32",
    "--config.model.num_layers=1",
    "--config.model.model_dim=32",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.num_train_steps=3",
    "--config.optimizer.warmup_steps=1",
    "--config.eval.num_sequences=8",
    "--config.eval.batch_size=8",
    "--config.sample.num_samples=1",
    "--config.sample.num_steps=4",
    config="configs/text8.py",
  )
  evaluation = json.loads((tmp_path / "eval.json").read_text())
  assert "true_bits_per_token" not in evaluation  # Real text: entropy unknown.
  assert 3.0 < evaluation["nelbo_bits_per_token"] < 6.0  # Near log2(27) = 4.75 after 3 steps.
  # One character per text8 token: bits/character is bits/token.
  assert evaluation["bits_per_character"] == pytest.approx(
    evaluation["nelbo_bits_per_token"], rel=1e-5
  )
  assert "bits/character" in (tmp_path / "eval.md").read_text()
  [sample] = read_jsonl(tmp_path / "samples.jsonl")
  assert len(sample["text"]) == 32 and set(sample["text"]) <= set("abcdefghijklmnopqrstuvwxyz ")


MD4_FLAGS = (
  "--config.model.preset=md4",
  "--config.model.mlp_dim=96",
  "--config.diffusion.schedule=md4linear",
  "--config.diffusion.endpoint_terms=md4",
  "--config.training.loss_units=bits",
  "--config.optimizer.grad_clip_norm=0",
  "--config.optimizer.ema_warmup=False",
)


@pytest.mark.slow  # 30 s: trains, evaluates and samples.
def test_md4_preset_runs_and_records_its_resolved_keys(tmp_path):
  """--config.model.preset=md4: config.json holds MD4's values; training, evaluation and
  sampling run the t-conditioned network."""
  run_cli(
    tmp_path,
    *MD4_FLAGS,
    "--config.num_train_steps=6",
    "--config.eval.discrete_steps=",
    "--config.sample.trajectory=False",
  )
  model = json.loads((tmp_path / "config.json").read_text())["model"]
  assert (
    model["preset"],
    model["time_input"],
    model["norm"],
    model["embed_dim"],
    model["time_dim"],
  ) == ("md4", "t", "layer", 16, 16)
  assert np.isfinite(json.loads((tmp_path / "eval.json").read_text())["nelbo_bits_per_token"])
  assert len(read_jsonl(tmp_path / "samples.jsonl")) == 2


def test_md4_preset_refuses_a_command_line_override_of_its_keys(tmp_path):
  result = run_cli(tmp_path, *MD4_FLAGS, "--config.model.norm=rms", check=False)
  assert (
    result.returncode != 0
    and "sets model.norm='layer', but the command line sets --config.model.norm='rms'"
    in result.stderr
  )
  assert len(result.stderr.strip().splitlines()) == 1  # One line, no traceback.
  assert not (tmp_path / "checkpoints").exists()


def _tiny_config():
  return config_lib.load_config("tiny")


def _final_state(workdir, config_overrides):
  config = _tiny_config()
  for key, value in config_overrides.items():
    setattr(config, key, value)
  abstract = state_lib.abstract_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config),
  )
  manager = checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, max_to_keep=3)
  restored = checkpoint.restore(manager, abstract)
  return restored.step, restored.state, restored.data_state


@pytest.mark.slow  # tests/test_chaos.py kills runs (also mid-save) and checks the resume bit for bit.
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
  steps, every = 300, 20
  flags = [
    f"--config.num_train_steps={steps}",
    f"--config.checkpoint_every_steps={every}",
    f"--config.log_every_steps={every}",
    f"--config.eval_every_steps={steps}",
  ]
  reference, killed = tmp_path / "reference", tmp_path / "killed"
  run_cli(reference, *flags)

  process = subprocess.Popen(
    cli(killed, *flags), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  first_checkpoint = killed / "checkpoints" / str(2 * every)
  deadline = time.monotonic() + 240
  while not first_checkpoint.is_dir() and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.005)
  assert process.poll() is None, "the run ended before it could be killed; raise num_train_steps"
  os.kill(process.pid, signal.SIGKILL)
  process.wait()
  saved = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and max(saved) < steps, "the kill must land before the last checkpoint"

  result = run_cli(killed, *flags)
  assert f"Resuming from the checkpoint of step {max(saved)}" in result.stdout

  overrides = dict(num_train_steps=steps, checkpoint_every_steps=every)
  step_ref, state_ref, data_ref = _final_state(reference, overrides)
  step_res, state_res, data_res = _final_state(killed, overrides)
  assert step_ref == step_res == steps and data_ref == data_res == {"next_batch_index": steps}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state_ref, state_res)
  metrics_ref, metrics_res = (
    read_jsonl(reference / "metrics.jsonl"),
    read_jsonl(killed / "metrics.jsonl"),
  )
  assert [r["step"] for r in metrics_res] == [r["step"] for r in metrics_ref]  # No duplicates.
  np.testing.assert_allclose(metrics_res[-1]["loss"], metrics_ref[-1]["loss"], rtol=1e-6)
  eval_ref = json.loads((reference / "eval.json").read_text())
  eval_res = json.loads((killed / "eval.json").read_text())
  np.testing.assert_allclose(
    eval_res["nelbo_bits_per_token"], eval_ref["nelbo_bits_per_token"], rtol=1e-6
  )


@pytest.mark.parametrize("config", ["tiny", "configs/default.py:bd3"])
def test_md4jax_configs_resolve_from_any_directory(tmp_path, config):
  """--config names md4jax's own configs (as a name or as configs/NAME.py) wherever the command
  runs: outside the repository the run gets as far as the missing checkpoint, in one line."""
  workdir = tmp_path / "work"
  result = subprocess.run(
    cli(workdir, "--mode=eval", config=config), cwd=tmp_path, capture_output=True, text=True
  )
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 1 and lines == [
    f"md4jax: error: No checkpoint in {workdir / 'checkpoints'}; run --mode=train on this "
    "workdir first."
  ], result.stderr[-2000:]


def test_a_config_that_names_nothing_is_one_line(tmp_path):
  result = subprocess.run(
    cli(tmp_path, config="nosuch"), cwd=tmp_path, capture_output=True, text=True
  )
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
    "md4jax: error: --config='nosuch': no file 'nosuch', and no md4jax config 'nosuch' "
    f"(md4jax's: {', '.join(config_lib.config_names())})."
  ]
