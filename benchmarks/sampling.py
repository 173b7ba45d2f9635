r"""Times every sampler of a named model size and prints one JSON object.

  python benchmarks/sampling.py --size=default
  python benchmarks/sampling.py --size=tiny --length=128 --steps=8,32,128
  python benchmarks/sampling.py --size=default --length=256 --batch_size=16 \
      --steps=1000 --methods=ancestral,cached,jump        # The cost-vs-T comparison.
  python benchmarks/sampling.py --size=default --length=1024 --block_size=16 \
      --generate=1024,4096 --methods=ancestral --steps=4  # Block diffusion, cache or not.

With --block_size, the model reads blocks (block diffusion) and each method generates
--generate tokens block after block with a context of --length tokens, twice: with the exact KV
cache (`md4jax.sample(..., cache="exact")`) and re-running the window at every call
(cache="none"); tokens/s, calls and the cache's bytes for each.

For each method and step count: sequences/s, the number of network calls
(NFE) and seconds per network call. The model has random parameters (speed
does not depend on training; cached NFE does slightly, through what is
revealed when). Each configuration is compiled once, then timed over --repeats
runs.
"""

import json
import time

import jax
from absl import app, flags

from md4jax import config as config_lib
from md4jax.diffusion import schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.runtime import allocator, sharding
from md4jax.sampling import decoder, samplers
from md4jax.training import state as state_lib

_SIZE = flags.DEFINE_enum(
  "size", "default", ["tiny", "default", "text8"], "Model size (config name)."
)
_LENGTH = flags.DEFINE_integer("length", None, "Sequence length; default: the config's seq_len.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Sequences per sampler call.")
_STEPS = flags.DEFINE_list("steps", ["16", "64", "256"], "Step counts of the grid methods.")
_METHODS = flags.DEFINE_list("methods", list(samplers.METHODS), "Sampling methods to time.")
_REPEATS = flags.DEFINE_integer(
  "repeats", 3, "Timed runs per configuration (after one compile run)."
)
_THRESHOLD = flags.DEFINE_float("threshold", 0.9, "The threshold of method 'threshold'.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 0, "Block diffusion's block; 0 = whole sequences.")
_GENERATE = flags.DEFINE_list(
  "generate", ["1024", "4096"], "With --block_size: tokens to generate."
)
_REUSE_MEMORY = flags.DEFINE_bool(
  "reuse_freed_host_memory",
  None,
  "glibc keeps freed memory instead of faulting in fresh pages (md4jax.runtime.allocator); "
  "default: the config's reuse_freed_host_memory, as md4jax.main does.",
)


def main(argv):
  del argv
  config = config_lib.load_config(_SIZE.value)
  reuse = config.reuse_freed_host_memory if _REUSE_MEMORY.value is None else _REUSE_MEMORY.value
  reused_memory = reuse and allocator.reuse_freed_host_memory()  # Before JAX's threads start.
  length = _LENGTH.value or config.data.seq_len
  model = state_lib.build_model(config)
  params = state_lib.init_state(
    config, model, state_lib.make_optimizer(config), sharding.make_mesh(config)
  ).params
  schedule = schedules.get_schedule(config.diffusion.schedule)
  if _BLOCK_SIZE.value:
    results = time_blocks(model.clone(block_size=_BLOCK_SIZE.value), params, length, schedule)
  else:
    results = time_whole(model, params, length, schedule)
  print(
    json.dumps(
      {
        "size": _SIZE.value,
        "length": length,
        "batch_size": _BATCH_SIZE.value,
        "block_size": _BLOCK_SIZE.value,
        "reuse_freed_host_memory": reused_memory,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "results": results,
      },
      indent=2,
    )
  )


def _settings(method: str):
  """(num_steps, threshold) of every configuration of a method."""
  stepless = method in ("first_hitting", "threshold")
  threshold = _THRESHOLD.value if method == "threshold" else None
  return [(num_steps, threshold) for num_steps in ([None] if stepless else map(int, _STEPS.value))]


def time_blocks(model, params, context: int, schedule) -> list:
  """Block diffusion with and without the KV cache, at every --generate length."""
  results = []
  denoiser = Denoiser.of_network(model, params)
  for method in _METHODS.value:
    for (num_steps, threshold), total in (
      (setting, int(total)) for setting in _settings(method) for total in _GENERATE.value
    ):
      common = dict(
        batch_size=_BATCH_SIZE.value,
        length=total,
        block_size=_BLOCK_SIZE.value,
        context_length=context,
        schedule=schedule,
        mask_id=model.vocab_size,
        method=method,
        num_steps=num_steps,
        threshold=threshold,
      )
      runs = {
        "cached": lambda key, common=common: decoder.sample(key, denoiser, cache="exact", **common),
        "window": lambda key, common=common: decoder.sample(key, denoiser, **common),
      }
      row = {"method": method, "num_steps": num_steps, "threshold": threshold, "tokens": total}
      for name, run in runs.items():
        _, info = run(jax.random.PRNGKey(0))  # Compiles.
        start, nfe = time.perf_counter(), 0
        for repeat in range(_REPEATS.value):
          _, info = run(jax.random.PRNGKey(repeat + 1))
          nfe += int(info["nfe"])  # Blocks until this run is done.
        seconds = (time.perf_counter() - start) / _REPEATS.value
        row[name] = {
          "seconds": seconds,
          "tokens_per_second": _BATCH_SIZE.value * total / seconds,
          "sampling_calls": nfe / _REPEATS.value,
          "cache_writes": int(info["cache_writes"]),
          "cache_bytes": int(info["cache_bytes"]),
        }
      row["cache_speedup"] = row["window"]["seconds"] / row["cached"]["seconds"]
      results.append(row)
  return results


def time_whole(model, params, length: int, schedule) -> list:
  """Every method over whole sequences of `length` tokens."""
  results = []
  for method in _METHODS.value:
    for num_steps, threshold in _settings(method):
      run = jax.jit(
        lambda key, params, method=method, num_steps=num_steps, threshold=threshold: decoder.sample(
          key,
          Denoiser.of_network(model, params),
          batch_size=_BATCH_SIZE.value,
          length=length,
          schedule=schedule,
          mask_id=model.vocab_size,
          method=method,
          num_steps=num_steps,
          threshold=threshold,
        )
      )
      jax.block_until_ready(run(jax.random.PRNGKey(0), params))
      start = time.perf_counter()
      nfe = 0
      for repeat in range(_REPEATS.value):
        tokens, info = run(jax.random.PRNGKey(repeat + 1), params)
        nfe += int(info["nfe"])  # Blocks until this run is done.
      seconds = time.perf_counter() - start
      results.append(
        {
          "method": method,
          "num_steps": num_steps,
          "threshold": threshold,
          "nfe": nfe / _REPEATS.value,
          "seconds_per_batch": seconds / _REPEATS.value,
          "sequences_per_second": _BATCH_SIZE.value * _REPEATS.value / seconds,
          "seconds_per_network_call": seconds / nfe,
        }
      )
  return results


if __name__ == "__main__":
  app.run(main)
