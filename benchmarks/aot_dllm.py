r"""LLaDA-8B and Dream-7B on TPU slices, compiled ahead of time on any CPU machine (issue 48, item 6).

  pip install -e ".[tpu]"
  JAX_PLATFORMS=cpu python benchmarks/aot_dllm.py [--models=llada,dream] \
      [--topologies=v5p:2x2x1,v5e:4x4,v6e:2x4] [--programs=sample_none,sample_dual,sft,lora]

For each model (configs/llada.py, configs/dream.py), topology and program, one
`python -m md4jax.aot` run (a process each, one at a time):

  sample_none  one network call of the sampler on 8 rows x 4096 tokens (sample.cache=none)
  sample_dual  Fast-dLLM's dual cache: a block of 32 tokens reading the cached keys and values of
               the 4096 positions, and the refresh call that writes them (two programs)
  sft          the full SFT train step: AdamW, float32 params, moments and EMA, bfloat16
               compute, remat full; the meshes of SFT_MESHES tried in order until one fits
  lora         LoRA SFT (model.lora_rank=LORA_RANK on every attention and MLP projection): the
               same step training only the adapters, on the same meshes

Prints one JSON list, a row per program as it is measured: fits, bytes_per_chip,
hbm_bytes_per_chip, step_seconds_at_50%_mfu (the model's FLOP formula at half the
chips' peak bf16 FLOP/s), compile_seconds, the mesh and the command that measured it.
An 8B program takes about a minute to compile on 2 cores.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Sampling: 8 rows split over at most 8 chips (a v5e-16's other factor of 2 is tensor parallel).
SAMPLE_MESHES = {
  "v5p:2x2x1": {"data": 1, "fsdp": 4, "tensor": 1},
  "v5e:4x4": {"data": 1, "fsdp": 8, "tensor": 2},
  "v6e:2x4": {"data": 1, "fsdp": 8, "tensor": 1},
}
# Full SFT: meshes tried in order, the first that fits is kept (FSDP over every chip first).
SFT_MESHES = {
  "v5p:2x2x1": [{"data": 1, "fsdp": 4, "tensor": 1}],
  "v5e:4x4": [{"data": 1, "fsdp": 16, "tensor": 1}, {"data": 1, "fsdp": 8, "tensor": 2}],
  "v6e:2x4": [{"data": 1, "fsdp": 8, "tensor": 1}, {"data": 1, "fsdp": 4, "tensor": 2}],
}
SFT_BATCH = 16  # Sequences of 4096 tokens per step (a v5e-16's 16 chips: one row each).
SAMPLE_ROWS = 8
LORA_RANK = 16  # PEFT's usual rank for 7-8B fine-tunes.
DUAL_BLOCK = 32


def mesh_flags(mesh: dict) -> list:
  return [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]


def run_aot(flags: list) -> tuple:
  """(report, command, wall seconds) of one md4jax.aot run (report None on an error)."""
  command = [sys.executable, "-m", "md4jax.aot", *flags]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  start = time.perf_counter()
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
  seconds = time.perf_counter() - start
  shown = "JAX_PLATFORMS=cpu python -m md4jax.aot " + " ".join(flags)
  if result.returncode:
    return {"error": result.stderr.strip().splitlines()[-1]}, shown, seconds
  return json.loads(result.stdout), shown, seconds


def program_row(model, topology, program, report, entry, command, **extra) -> dict:
  """One table row of `entry` (a program's part of an md4jax.aot report)."""
  if "error" in report:
    return {"model": model, "topology": topology, "program": program, **report, "command": command}
  at_mfu = entry.get("step_seconds_at_mfu") or report.get("step_seconds_at_mfu") or {}
  return {
    "model": model,
    "topology": topology,
    "program": program,
    "fits": entry.get("fits", report["fits"]),
    "bytes_per_chip": entry.get("bytes_per_chip", report.get("bytes_per_chip")),
    "hbm_bytes_per_chip": report["hbm_bytes_per_chip"],
    "step_seconds_at_50%_mfu": at_mfu.get("50%"),
    "compile_seconds": entry.get("compile_seconds", report.get("compile_seconds")),
    "compile_error": entry.get("compile_error", report.get("compile_error")),
    "chips": report["chips"],
    "mesh": report["mesh"],
    **extra,
    "command": command,
  }


def measure(model: str, topology: str, program: str) -> list:
  """The rows of one (model, topology, program)."""
  config = [f"--config=configs/{model}.py", f"--topology={topology}"]
  if program in ("sample_none", "sample_dual"):
    cache = program.split("_")[1]
    flags = config + [
      "--programs=sampler",
      f"--config.sample.cache={cache}",
      # Dream's shifted logits decode without a cache in md4jax: its dual rows price the shape.
      *(["--config.model.shift_logits=false"] if model == "dream" and cache == "dual" else []),
      f"--config.sample.block_length={DUAL_BLOCK}",
      f"--config.eval.batch_size={SAMPLE_ROWS}",
      f"--config.batch_size={SFT_BATCH}",
      *mesh_flags(SAMPLE_MESHES[topology]),
    ]
    report, command, _ = run_aot(flags)
    names = ["sampler_step"] + (["sampler_refresh"] if cache == "dual" else [])
    rows = []
    for name in names:
      entry = report.get(name, {})
      label = f"{program}:{'block_call' if cache == 'dual' and name == 'sampler_step' else name}"
      if cache == "none":
        label = "sample_none:full_call"
      rows.append(
        program_row(
          model,
          topology,
          label,
          report,
          entry,
          command,
          rows=entry.get("rows"),
          tokens_per_row=entry.get("tokens"),
        )
      )
    return rows
  lora = program == "lora"
  if lora:
    config.append(f"--config.model.lora_rank={LORA_RANK}")
  rows = []
  for mesh in SFT_MESHES[topology]:
    flags = config + [
      "--programs=train",
      "--count_flops=false",
      f"--config.batch_size={SFT_BATCH}",
      f"--config.eval.batch_size={SFT_BATCH}",  # Validation splits it over the batch axes too.
      *mesh_flags(mesh),
    ]
    report, command, _ = run_aot(flags)
    entry = report.get("train_step", {})
    rows.append(
      program_row(
        model,
        topology,
        "lora_sft" if lora else "full_sft",
        report,
        entry,
        command,
        global_batch=SFT_BATCH,
        remat="full",
        params=report.get("params"),
      )
    )
    if report.get("fits"):
      break
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="llada,dream")
  parser.add_argument("--topologies", default=",".join(SAMPLE_MESHES))
  parser.add_argument("--programs", default="sample_none,sample_dual,sft,lora")
  args = parser.parse_args()
  print("[", flush=True)
  first = True
  for model in args.models.split(","):
    for topology in args.topologies.split(","):
      for program in args.programs.split(","):
        for row in measure(model, topology, program):
          print(("" if first else ",\n") + json.dumps(row), end="", flush=True)
          first = False
  print("\n]", flush=True)


if __name__ == "__main__":
  main()
