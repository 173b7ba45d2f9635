r"""Compiles a config's train step, eval step and one sampler step for a TPU topology, on any machine.

  pip install -e ".[tpu]"
  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/owt.py --topology=v5e:4x4 \
      [--config.mesh.fsdp=16 --config.mesh.data=1 ...] [--programs=train,eval,sampler] \
      [--count_flops=false]

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

--programs picks which of the three are compiled (an 8B program takes minutes
each); without the train step, "fits" is whether every compiled program fits.
Each program's entry carries its own fits, bytes_per_chip and compile_seconds;
the sampler's also model_flops and step_seconds_at_mfu (one forward pass).

The sampler step follows config.sample.cache: "none" is one network call on
eval.batch_size rows of seq_len tokens; "prefix" and "dual" (Fast-dLLM's caches,
`md4jax.sampling.decoder`) report two programs, "sampler_step" (one call on a
block of sample.block_length tokens reading the keys and values of the seq_len
cached positions) and "sampler_refresh" (the call on the whole sequence that
writes them, once per block). --count_flops=false skips the train step's
loop-free FLOP count (two more compiles).

--programs=post_train compiles a post-training step (`md4jax.app.post_train`: batch_size
prompts × post_train.group_size rollouts of sample.num_steps calls, the log π estimates and
the updates, one program) and reports its bytes and model FLOPs (`costs.post_train_flops`).
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
from md4jax.app import costs, post_train
from md4jax.data import sources
from md4jax.diffusion import denoiser as denoiser_lib
from md4jax.evaluation import evaluate
from md4jax.posttraining import rewards
from md4jax.runtime import sharding
from md4jax.sampling import blocks, decoder
from md4jax.training import objective, train
from md4jax.training import state as state_lib

PROGRAMS = ("train", "eval", "sampler", "post_train")
DEFAULT_PROGRAMS = PROGRAMS[:3]  # post_train on request: a step of rollouts compiles for minutes.

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a config file (configs/*.py).", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string(
  "topology", "v5e:2x2", "TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:16x16."
)
_PROGRAMS = flags.DEFINE_list(
  "programs",
  ",".join(DEFAULT_PROGRAMS),
  "The programs to compile, any of train, eval, sampler (the sampler's follows sample.cache) "
  "and post_train (a GRPO step: rollouts and update, md4jax.app.post_train).",
)
_COUNT_FLOPS = flags.DEFINE_bool(
  "count_flops",
  True,
  "Count the train step's FLOPs on loop-free compiles (flops_ratio; two more compiles).",
)
flags.mark_flags_as_required(["config"])


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


def _summary(compiled, seconds: float, num_devices: int) -> dict:
  # XLA's own count, which sees each loop body (scanned layers, sampler steps) once.
  return {
    "compile_seconds": round(seconds, 2),
    "bytes_per_chip": costs.compiled_memory(compiled)["total"],
    "memory_breakdown": costs.compiled_memory(compiled),
    "xla_cost_analysis_flops_all_chips": costs.compiled_flops(compiled) * num_devices,
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
  optimizer's per-parameter FLOPs, under 0.1% of a step, scale along). None when
  those compiles do not fit a chip (they hold whole params and optimizer state).
  """
  flops = []
  for num_layers in (1, 2):
    counted = config.copy_and_resolve_references()
    counted.model.num_layers, counted.model.scan_layers = num_layers, False
    counted.mesh.data, counted.mesh.fsdp, counted.mesh.tensor = -1, 1, 1
    counted.batch_size, counted.training.grad_accum_steps = len(devices), 1
    mesh = sharding.make_mesh(counted, devices)
    try:
      flops.append(costs.compiled_flops(_train_step_compiled(counted, mesh)[0]) * len(devices))
    except DoesNotFit:  # Whole params per chip: an 8B model's do not fit one.
      return None
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
        mask_id=None if config.diffusion.process == "uniform" else config.data.vocab_size,
        method="ancestral",
        num_steps=1,
        process=config.diffusion.process,
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
    # Under uniform noise a block's call reads each position's keep probability [rows, b].
    shape = (rows, block) if config.diffusion.process == "uniform" else (rows,)
    with sharding.activation_rules(mesh):
      logits, _ = denoiser.block_call(tokens, jnp.full(shape, 0.5, jnp.float32), positions, cache)
    return jnp.argmax(logits, axis=-1)

  return jax.jit(step, out_shardings=sharding.batch_sharding(mesh))


def _kv_sharding(config, mesh):
  """Cached keys or values [N, rows, C, Hkv, Dh]: rows over the batch axes, heads over tensor."""
  kv_heads = config.model.num_kv_heads or config.model.num_heads
  heads = "tensor" if kv_heads % mesh.shape["tensor"] == 0 else None
  return jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES, None, heads, None)
  )


def fast_dllm_calls(config, model, mesh) -> dict:
  """sample.cache "prefix" or "dual" (`blocks._block`): {"sampler_step": (the call of one block
  of sample.block_length tokens reading the cached keys and values of all seq_len positions,
  its abstract arguments after params), "sampler_refresh": (the call on the whole sequence
  that writes them, its arguments)}, on eval.batch_size rows."""
  rows, length, block = config.eval.batch_size, config.data.seq_len, config.sample.block_length
  layout = denoiser_lib.Denoiser.of_network(model, None).cache_layout
  kv = _kv_sharding(config, mesh)
  cached = jax.ShapeDtypeStruct(layout.shape(rows, length), layout.dtype, sharding=kv)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
  clean = jnp.ones((rows,), jnp.float32)  # The refresh reads the tokens as they stand.
  start = length - block  # The last block: every block's call costs the same.

  def block_call(params, key, k, v):
    denoiser = objective.sampling_denoiser(model, params, config)
    tokens = jax.random.randint(key, (rows, block), 0, config.data.vocab_size)
    valid = blocks.readable_columns(config.sample.cache, length, start, block)
    positions = jnp.broadcast_to(start + jnp.arange(block), (rows, block))
    with sharding.activation_rules(mesh):
      logits, _ = denoiser.block_call(tokens, clean, positions, {"k": k, "v": v, "valid": valid})
    return jnp.argmax(logits, axis=-1)

  def refresh(params, key):
    denoiser = objective.sampling_denoiser(model, params, config)
    tokens = jax.random.randint(key, (rows, length), 0, config.data.vocab_size + 1)
    everywhere = jnp.broadcast_to(jnp.arange(length), (rows, length))
    with sharding.activation_rules(mesh):
      _, written = denoiser.block_call(tokens, clean, everywhere, layout.empty(rows, 0))
    return written["k"], written["v"]

  batch = sharding.batch_sharding(mesh)
  return {
    "sampler_step": (jax.jit(block_call, out_shardings=batch), (key, cached, cached)),
    "sampler_refresh": (jax.jit(refresh, out_shardings=(kv, kv)), (key,)),
  }


def _program_report(compile_fn, num_devices: int, hbm_bytes: int) -> tuple:
  """(compiled program or None, its summary with "fits"; a refused one: its required bytes)."""
  try:
    compiled, seconds = compile_fn()
  except DoesNotFit as e:
    return None, {"fits": False, "bytes_per_chip": e.required_bytes, "compile_error": str(e)}
  summary = _summary(compiled, seconds, num_devices)
  return compiled, {"fits": summary["bytes_per_chip"] <= hbm_bytes, **summary}


def analyze(config, topology: str, programs=DEFAULT_PROGRAMS, count_flops: bool = True) -> dict:
  """The AOT report of `config` on TPU slice `topology` (see the module docstring): the
  `programs` named (of PROGRAMS), the train step's FLOPs counted when count_flops."""
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown or not programs:
    raise ValueError(f"--programs takes some of {', '.join(PROGRAMS)}; got {list(programs)}.")
  config = config_lib.expand_preset(config)
  devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
  specs = costs.chip_specs(devices)
  mesh = sharding.make_mesh(config, devices)
  if not config.data.path:  # Compiling reads no data: a preset may leave the path to the run.
    config = config.copy_and_resolve_references()
    config.data.path = "<data.path: read by a run only>"
  config_lib.validate_config(config, len(devices), "tpu")
  if not config.data.vocab_size:
    raise ValueError(
      "data.vocab_size=0 takes the tokenizer's size, which only a run reads: give it for the "
      "ahead-of-time check (--config.data.vocab_size=N)."
    )
  model = state_lib.build_model(config)
  seq_len = config.data.seq_len
  model_flops = costs.model_flops_per_step(config, model)
  hbm = specs["hbm_bytes"]
  peak = specs["peak_bf16_flops"] * len(devices)
  at_mfu = lambda flops: {"100%": flops / peak, "50%": flops / (0.5 * peak)}
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
    "programs": list(programs),
  }
  optimizer = state_lib.make_optimizer(config)
  abstract = state_lib.abstract_state(config, model, optimizer, mesh)
  report = {"hbm_bytes_per_chip": hbm}
  if "train" in programs:
    try:
      train_compiled, train_seconds, abstract = _train_step_compiled(config, mesh)
    except DoesNotFit as e:
      return {
        "fits": False,
        "bytes_per_chip": e.required_bytes,
        "hbm_bytes_per_chip": hbm,
        "compile_error": str(e),
        **where,
      }
    train_summary = _summary(train_compiled, train_seconds, len(devices))
    report.update(
      fits=train_summary["bytes_per_chip"] <= hbm,
      bytes_per_chip=train_summary["bytes_per_chip"],
      hbm_bytes_per_chip=hbm,
    )
    if count_flops:
      train_summary["flops_all_chips"] = _train_flops(config, devices)
      train_summary["flops_counted"] = (
        "loop-free compiles: data parallel, 1 row per device, 1 and 2 "
        "layers unrolled; extrapolated to num_layers and the batch"
        if train_summary["flops_all_chips"] is not None
        else "not counted: the loop-free compiles (whole params on every chip) do not fit"
      )
      if train_summary["flops_all_chips"] is not None:
        report["flops_ratio"] = train_summary["flops_all_chips"] / model_flops
    report.update(
      compile_seconds=train_summary["compile_seconds"], step_seconds_at_mfu=at_mfu(model_flops)
    )
  report.update(where)
  report["params"] = sum(leaf.size for leaf in jax.tree.leaves(abstract.params))
  report["flop_formula"] = (
    "md4jax.app.costs.model_flops_per_step: 3 * flops_per_token * batch_size * "
    "seq_len (block diffusion: over 2 seq_len tokens, logits for seq_len)"
  )
  if "train" in programs:
    report["train_step"] = train_summary
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
  if "eval" in programs:
    eval_fn = evaluate.make_eval_fn(config, model, mesh, with_profile=False)
    batch = _abstract_batch(config, config.eval.batch_size, mesh, training=False)
    _, summary = _program_report(
      lambda: _compile(eval_fn, abstract.ema_params, batch, key), len(devices), hbm
    )
    report["eval_step"] = {
      **summary,
      "rows": config.eval.batch_size,
      "mc_draws": config.eval.num_mc_samples,
    }
  if "sampler" in programs:
    if config.sample.cache in ("prefix", "dual") and not model.block_size:
      calls = fast_dllm_calls(config, model, mesh)
    else:
      calls = {"sampler_step": (sampler_step(config, model, mesh), (key,))}
    for name, (fn, args) in calls.items():
      _, summary = _program_report(
        lambda fn=fn, args=args: _compile(fn, abstract.ema_params, *args), len(devices), hbm
      )
      flops = costs.sampler_flops(config, model, name)
      report[name] = {
        **summary,
        "rows": config.eval.batch_size,
        "cache": "exact" if model.block_size else config.sample.cache,
        "tokens": costs.call_tokens(config, model, name),
        "model_flops": flops,
        "step_seconds_at_mfu": at_mfu(flops),
      }
  if "post_train" in programs:
    report["post_train_step"] = _post_train_report(config, model, optimizer, abstract, mesh, hbm)
    report["post_train_step"]["step_seconds_at_mfu"] = at_mfu(
      report["post_train_step"]["model_flops"]
    )
  if "train" not in programs:
    compiled = ("eval_step", "sampler_step", "sampler_refresh", "post_train_step")
    report["fits"] = all(report[name]["fits"] for name in compiled if name in report)
  return {"fits": report.pop("fits"), **report}


def _post_train_report(config, model, optimizer, abstract, mesh, hbm) -> dict:
  """The post-training step (batch_size prompts × group_size rollouts of sample.num_steps calls,
  then the estimates and updates) compiled as the run compiles it, with exact_match as the
  reward (in the program, no table: its cost is nothing beside the calls')."""
  step = post_train.programs(config, model, optimizer, abstract, mesh, rewards.ExactMatch())
  prompts = _abstract_batch(config, config.batch_size, mesh, training=True)
  _, summary = _program_report(
    lambda: _compile(step, abstract, prompts, abstract.params), mesh.devices.size, hbm
  )
  cfg = config.post_train
  return {
    **summary,
    "prompts": config.batch_size,
    "rollouts": config.batch_size * cfg.group_size,
    "sampler_calls": config.sample.num_steps,
    "likelihood": f"{cfg.likelihood} x {cfg.likelihood_draws}",
    "updates_per_rollout": cfg.updates_per_rollout,
    "model_flops": costs.post_train_flops(config, model),
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  # libtpu takes a machine-wide lock when it loads; compiling for a described topology opens no
  # TPU, so several of these (or one beside a test run) may share the machine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  with user_errors.in_one_line("md4jax.aot", (ValueError,), flags.FLAGS["verbosity"].present):
    report = analyze(_CONFIG.value, _TOPOLOGY.value, tuple(_PROGRAMS.value), _COUNT_FLOPS.value)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)
