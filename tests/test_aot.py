"""The AOT tool compiles real TPU programs on this CPU machine (libtpu's compiler, no TPU)."""

import json
import pathlib
import subprocess
import sys

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
