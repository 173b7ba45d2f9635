r"""Compiles a config's train step, eval step and one sampler step for a TPU topology, on any machine.

  pip install -e ".[tpu]"
  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/owt.py --topology=v5e:4x4 \
      [--config.mesh.fsdp=16 --config.mesh.data=1 ...]

libtpu's compiler builds the real sharded programs for the named slice
(`jax.experimental.topologies`), so whether a config fits, and how fast it
could run, is known before any TPU is rented. Prints one JSON object:

  fits                 the train step's bytes per chip are within the chip's HBM
  bytes_per_chip       arguments + outputs + temporaries − aliased (donated) bytes
  hbm_bytes_per_chip   the chip's HBM
  flops_ratio          compiled train-step FLOPs summed over all chips / the model's FLOP
                       formula for the global batch (about 1; above 1 with remat). XLA counts
                       a loop body once, so the FLOPs come from loop-free compiles of the same
                       step (`_train_flops`)
  compile_seconds      the train step's compile time
  step_seconds_at_mfu  the step time implied at the chip's peak bf16 FLOP/s at 100% and 50% MFU

with the memory breakdown and the eval and sampler steps beside them. A
config that does not fit prints "fits": false with what it needs (the bytes
the compiler reports when it refuses the program) and exits 0.
"""

import json
import os
import re
import time
from typing import Optional

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental import topologies
from ml_collections import config_flags

from md4jax import config as config_lib
from md4jax import user_errors
from md4jax.data import sources
from md4jax.evaluation import evaluate
from md4jax.model import transformer as model_lib
from md4jax.runtime import sharding
from md4jax.sampling import decoder
from md4jax.training import objective, train
from md4jax.training import state as state_lib

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a config file (configs/*.py).", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string(
  "topology", "v5e:2x2", "TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:16x16."
)
flags.mark_flags_as_required(["config"])

# Per chip: HBM bytes and peak dense bfloat16 FLOP/s (Cloud TPU documentation).
CHIPS = {
  "TPU v4": {"hbm_bytes": 32 * 2**30, "peak_bf16_flops": 275e12},
  "TPU v5 lite": {"hbm_bytes": 16 * 2**30, "peak_bf16_flops": 197e12},
  "TPU v5": {"hbm_bytes": 95 * 2**30, "peak_bf16_flops": 459e12},
  "TPU v6 lite": {"hbm_bytes": 32 * 2**30, "peak_bf16_flops": 918e12},
}


def chip_specs(devices) -> dict:
  """HBM and peak FLOP/s per JAX device (a v4 chip shows up as two devices, one per core)."""
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise ValueError(f"No HBM/FLOP figures for {kind!r}; known: {', '.join(CHIPS)}.")
  devices_per_chip = len({d.core_on_chip for d in devices})
  return {
    "device_kind": kind,
    "devices_per_chip": devices_per_chip,
    "hbm_bytes": CHIPS[kind]["hbm_bytes"] // devices_per_chip,
    "peak_bf16_flops": CHIPS[kind]["peak_bf16_flops"] / devices_per_chip,
  }


def _abstract_batch(config, rows: int, mesh, training: bool) -> dict:
  """The batch config's data gives the train step (or the evaluation), as shapes."""
  spec = lambda dtype: jax.ShapeDtypeStruct(
    (rows, config.data.seq_len), dtype, sharding=sharding.batch_sharding(mesh)
  )
  segments = sources.has_segments(config, training)
  return {
    "tokens": spec(jnp.int32),
    "segment_ids": spec(jnp.int32) if segments else None,
    "positions": spec(jnp.int32) if segments else None,
    "editable": spec(jnp.bool_),
  }


class DoesNotFit(Exception):
  """The compiler refused the program: it needs more than the chip's HBM."""

  def __init__(self, message: str, required_bytes: Optional[int]):
    super().__init__(message)
    self.required_bytes = required_bytes


def _compile(fn, *args) -> tuple:
  start = time.perf_counter()
  try:
    compiled = fn.lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # e.g. "... the total memory required for HLO temporaries (28.53G) exceeds available HBM ..."
    found = re.search(r"required for [^(]*\(([0-9.]+)([KMGT])\)", str(e))
    required = (
      int(float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10)) if found else None
    )
    raise DoesNotFit(str(e).splitlines()[0], required) from None
  return compiled, time.perf_counter() - start


def _memory(compiled) -> dict:
  stats = compiled.memory_analysis()
  memory = {
    name: int(getattr(stats, f"{name}_size_in_bytes"))
    for name in ("argument", "output", "temp", "alias", "generated_code")
  }
  memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
  return memory


def compiled_flops(compiled) -> float:
  """XLA's FLOP count of a compiled program (cost_analysis is a dict, or a list of one)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def _summary(compiled, seconds: float, num_devices: int) -> dict:
  # XLA's own count, which sees each loop body (scanned layers, sampler steps) once.
  return {
    "compile_seconds": round(seconds, 2),
    "bytes_per_chip": _memory(compiled)["total"],
    "memory_breakdown": _memory(compiled),
    "xla_cost_analysis_flops_all_chips": compiled_flops(compiled) * num_devices,
  }


def _train_step_compiled(config, mesh):
  """(compiled train step, compile seconds, abstract state) of `config` on `mesh`."""
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, mesh)
  step_fn = train.make_train_step(config, model, optimizer, mesh, abstract)
  compiled, seconds = _compile(
    step_fn, abstract, _abstract_batch(config, config.batch_size, mesh, training=True)
  )
  return compiled, seconds, abstract


def _train_flops(config, devices) -> float:
  """The train step's FLOPs for the global batch, all chips.

  XLA's cost analysis counts a loop's body once, and the step has loops: a
  scanned layer stack, and the collective matmuls an FSDP mesh compiles to. So
  the FLOPs are counted on loop-free compiles of the same step: data parallel,
  one row per device, unrolled at 1 and 2 layers, extrapolated linearly to
  model.num_layers (identical layers) and scaled to the global batch (the
  optimizer's per-parameter FLOPs, under 0.1% of a step, scale along).
  """
  flops = []
  for num_layers in (1, 2):
    counted = config.copy_and_resolve_references()
    counted.model.num_layers, counted.model.scan_layers = num_layers, False
    counted.mesh.data, counted.mesh.fsdp, counted.mesh.tensor = -1, 1, 1
    counted.batch_size, counted.training.grad_accum_steps = len(devices), 1
    mesh = sharding.make_mesh(counted, devices)
    flops.append(compiled_flops(_train_step_compiled(counted, mesh)[0]) * len(devices))
  per_row = (flops[0] + (config.model.num_layers - 1) * (flops[1] - flops[0])) / len(devices)
  return per_row * config.batch_size


def sampler_step(config, model, mesh):
  """One ancestral step (one network call and its reveals) on eval.batch_size rows, jitted; for
  block diffusion one call of the cached block sampler (a block against a full KV cache)."""
  if model.block_size:
    return _block_sampler_call(config, model, mesh)

  def step(params, key):
    with sharding.activation_rules(mesh):
      tokens, _ = decoder.sample(
        key,
        objective.sampling_denoiser(model, params, config),
        batch_size=config.eval.batch_size,
        length=config.data.seq_len,
        schedule=objective.schedule_of(params, config),
        mask_id=config.data.vocab_size,
        method="ancestral",
        num_steps=1,
      )
    return tokens

  return jax.jit(step, out_shardings=sharding.batch_sharding(mesh))


def _block_sampler_call(config, model, mesh):
  """The block decoder's exact-cache call: b tokens read the cache of seq_len − b positions."""
  rows, block = config.eval.batch_size, model.block_size
  slots = config.data.seq_len - block

  def step(params, key):
    denoiser = objective.sampling_denoiser(model, params, config)
    tokens = jax.random.randint(key, (rows, block), 0, config.data.vocab_size)
    cache = {**denoiser.cache_layout.empty(rows, slots), "valid": jnp.ones(slots, bool)}
    positions = jnp.broadcast_to(slots + jnp.arange(block), (rows, block))
    with sharding.activation_rules(mesh):
      logits, _ = denoiser.block_call(tokens, jnp.ones((rows,), jnp.float32), positions, cache)
    return jnp.argmax(logits, axis=-1)

  return jax.jit(step, out_shardings=sharding.batch_sharding(mesh))


def model_flops_per_step(config, model) -> float:
  """3 × the forward FLOPs of a step's tokens (`flops_per_token`); block diffusion's forward
  reads 2L tokens (z_t ⊕ x, attention over 2L) and computes logits for the first L only."""
  m, seq_len = config.model, config.data.seq_len
  streams = 2 if model.block_size else 1
  per_token = model_lib.flops_per_token(
    m.num_layers, m.model_dim, m.mlp_dim, streams * seq_len, config.data.vocab_size
  )
  logits = 2 * m.model_dim * config.data.vocab_size  # Per token, of the noisy stream alone.
  forward = streams * seq_len * per_token - (streams - 1) * seq_len * logits
  return 3 * forward * config.batch_size


def analyze(config, topology: str) -> dict:
  """The AOT report of `config` on TPU slice `topology` (see the module docstring)."""
  config = config_lib.expand_preset(config)
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  specs = chip_specs(devices)
  mesh = sharding.make_mesh(config, devices)
  config_lib.validate_config(config, len(devices), "tpu")
  if not config.data.vocab_size:
    raise ValueError(
      "data.vocab_size=0 takes the tokenizer's size, which only a run reads: give it for the "
      "ahead-of-time check (--config.data.vocab_size=N)."
    )
  model = state_lib.build_model(config)
  seq_len = config.data.seq_len
  model_flops = model_flops_per_step(config, model)
  where = {
    "topology": topology,
    "chips": len(devices) // specs["devices_per_chip"],
    "devices": len(devices),
    "hosts": len({d.process_index for d in devices}),
    "device_kind": specs["device_kind"],
    "mesh": dict(zip(sharding.MESH_AXES, mesh.devices.shape)),
    "global_batch": config.batch_size,
    "seq_len": seq_len,
    "model_flops_per_step": model_flops,
  }
  try:
    train_compiled, train_seconds, abstract = _train_step_compiled(config, mesh)
  except DoesNotFit as e:
    return {
      "fits": False,
      "bytes_per_chip": e.required_bytes,
      "hbm_bytes_per_chip": specs["hbm_bytes"],
      "compile_error": str(e),
      **where,
    }
  eval_fn = evaluate.make_eval_fn(config, model, mesh, with_profile=False)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
  eval_compiled, eval_seconds = _compile(
    eval_fn,
    abstract.ema_params,
    _abstract_batch(config, config.eval.batch_size, mesh, training=False),
    key,
  )
  sampler_compiled, sampler_seconds = _compile(
    sampler_step(config, model, mesh), abstract.ema_params, key
  )

  train_summary = _summary(train_compiled, train_seconds, len(devices))
  train_summary["flops_all_chips"] = _train_flops(config, devices)
  train_summary["flops_counted"] = (
    "loop-free compiles: data parallel, 1 row per device, 1 and 2 "
    "layers unrolled; extrapolated to num_layers and the batch"
  )
  peak = specs["peak_bf16_flops"] * len(devices)
  return {
    "fits": train_summary["bytes_per_chip"] <= specs["hbm_bytes"],
    "bytes_per_chip": train_summary["bytes_per_chip"],
    "hbm_bytes_per_chip": specs["hbm_bytes"],
    "flops_ratio": train_summary["flops_all_chips"] / model_flops,
    "compile_seconds": train_summary["compile_seconds"],
    "step_seconds_at_mfu": {"100%": model_flops / peak, "50%": model_flops / (0.5 * peak)},
    **where,
    "params": sum(leaf.size for leaf in jax.tree.leaves(abstract.params)),
    "flop_formula": "md4jax.aot.model_flops_per_step: 3 * flops_per_token * batch_size * "
    "seq_len (block diffusion: over 2 seq_len tokens, logits for seq_len)",
    "train_step": train_summary,
    "eval_step": {
      **_summary(eval_compiled, eval_seconds, len(devices)),
      "rows": config.eval.batch_size,
      "mc_draws": config.eval.num_mc_samples,
    },
    "sampler_step": {
      **_summary(sampler_compiled, sampler_seconds, len(devices)),
      "rows": config.eval.batch_size,
    },
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  # libtpu takes a machine-wide lock when it loads; compiling for a described topology opens no
  # TPU, so several of these (or one beside a test run) may share the machine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with user_errors.in_one_line("md4jax.aot", (ValueError,), flags.FLAGS["verbosity"].present):
    report = analyze(_CONFIG.value, _TOPOLOGY.value)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)
