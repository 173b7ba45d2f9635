r"""Times the jitted train step of a named model size and prints one JSON object.

  python benchmarks/train_step.py --size=default
  python benchmarks/train_step.py --size=text8 --batch_size=2

Sizes are the configs of the same name (configs/tiny.py, default.py, text8.py);
text8 runs at a CPU-sized batch unless --batch_size says otherwise. The step
is compiled once, then timed over --steps steps on random tokens. The same run
times a 2048x2048 float32 matmul, so the achieved GFLOP/s reads as a fraction
of what this machine's matmul reaches.
"""

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from md4jax import config_lib
from md4jax import data
from md4jax import model as model_lib
from md4jax import sharding
from md4jax import state as state_lib
from md4jax import train

_SIZE = flags.DEFINE_enum("size", "default", ["tiny", "default", "text8"], "Model size (config name).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Global batch; default: the config's (text8: 2).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (after one compile step).")

_CPU_TEXT8_BATCH = 2
_FLOP_FORMULA = ("3 * flops_per_token * tokens, flops_per_token = 2 * (N (4 D^2 + 3 D F) + D V) "
                 "+ 4 N L D (md4jax.model.flops_per_token; backward = 2x forward)")


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
  """float32 n x n matmul throughput of the default device, GFLOP/s."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  matmul = jax.jit(lambda x: x @ a)
  matmul(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = matmul(a)
  out.block_until_ready()
  return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def main(argv):
  del argv
  config = config_lib.load_config(_SIZE.value)
  if _BATCH_SIZE.value is not None or _SIZE.value == "text8":
    config.batch_size = _BATCH_SIZE.value or _CPU_TEXT8_BATCH
  mesh = sharding.make_mesh(config)
  config_lib.validate_config(config, mesh.devices.size, mesh.devices.flat[0].platform)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  step_fn = train.make_train_step(config, model, optimizer, mesh, state)
  shape = (config.batch_size, config.data.seq_len)
  batches = [sharding.device_batch(data.dense_batch(np.random.default_rng(i).integers(
      0, config.data.vocab_size, shape, dtype=np.int32)), mesh) for i in range(2)]
  start = time.perf_counter()
  state, metrics = step_fn(state, batches[0])
  jax.block_until_ready(metrics)
  compile_seconds = time.perf_counter() - start
  start = time.perf_counter()
  for i in range(_STEPS.value):
    state, metrics = step_fn(state, batches[i % 2])
  jax.block_until_ready((state, metrics))
  seconds = time.perf_counter() - start

  m = config.model
  tokens = _STEPS.value * config.batch_size * config.data.seq_len
  flops = 3 * model_lib.flops_per_token(m.num_layers, m.model_dim, m.mlp_dim, config.data.seq_len,
                                        config.data.vocab_size) * tokens
  achieved, peak = flops / seconds / 1e9, matmul_gflops()
  print(json.dumps({
      "size": _SIZE.value,
      "model_type": m.type,
      "params": model_lib.count_params(state.params),
      "batch_size": config.batch_size,
      "seq_len": config.data.seq_len,
      "devices": f"{mesh.devices.size} x {jax.devices()[0].device_kind}",
      "compile_seconds": round(compile_seconds, 2),
      "timed_steps": _STEPS.value,
      "seconds_per_step": seconds / _STEPS.value,
      "tokens_per_second": tokens / seconds,
      "achieved_gflops_per_second": achieved,
      "flop_formula": _FLOP_FORMULA,
      "matmul_f32_2048_gflops_per_second": peak,
      "achieved_over_matmul": achieved / peak,
  }, indent=2))


if __name__ == "__main__":
  app.run(main)
