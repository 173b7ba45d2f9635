r"""Times every sampler of a named model size and prints one JSON object.

  python benchmarks/sampling.py --size=default
  python benchmarks/sampling.py --size=tiny --length=128 --steps=8,32,128
  python benchmarks/sampling.py --size=default --length=256 --batch_size=16 \
      --steps=1000 --methods=ancestral,cached,jump        # The cost-vs-T comparison.

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

from md4jax import config_lib
from md4jax.diffusion import schedules
from md4jax.runtime import allocator, sharding
from md4jax.sampling import samplers
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
  mask_id = config.data.vocab_size
  params = state_lib.init_state(
    config, model, state_lib.make_optimizer(config), sharding.make_mesh(config)
  ).params
  schedule = schedules.get_schedule(config.diffusion.schedule)
  results = []
  for method in _METHODS.value:
    stepless = method in ("first_hitting", "threshold")
    threshold = _THRESHOLD.value if method == "threshold" else None
    for num_steps in [None] if stepless else [int(s) for s in _STEPS.value]:
      run = jax.jit(
        lambda key, params, method=method, num_steps=num_steps, threshold=threshold: (
          samplers.sample(
            key,
            lambda z, a: model.apply({"params": params}, z, a),
            batch_size=_BATCH_SIZE.value,
            length=length,
            schedule=schedule,
            mask_id=mask_id,
            method=method,
            num_steps=num_steps,
            threshold=threshold,
          )
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
  print(
    json.dumps(
      {
        "size": _SIZE.value,
        "length": length,
        "batch_size": _BATCH_SIZE.value,
        "reuse_freed_host_memory": reused_memory,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "results": results,
      },
      indent=2,
    )
  )


if __name__ == "__main__":
  app.run(main)
