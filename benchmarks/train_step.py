r"""Times the jitted train step of a named model size and prints one JSON object.

  python benchmarks/train_step.py --size=default
  python benchmarks/train_step.py --size=4x256 --profile --trace

Sizes are the configs of the same name (configs/tiny.py, default.py and its variants, text8.py;
text8 at a CPU-sized batch unless --batch_size says otherwise) and three
text8-vocabulary models at MD4's shapes (head dim 64, MD4's MLP width):
4x256 (B16 x L128), 6x384 (B16 x L256) and 12x768 (B16 x L256); the text8 sizes
run in float32 on 2 CPU devices with freed memory reused (benchmark_config). The step is
compiled once, run --warmup_steps times untimed (with freed memory reused, the heap grows
over the first steps until enough freed blocks exist, and those steps are slower:
docs/performance.md), then timed over --steps steps on random tokens, best of --rounds (every
round's time is in the JSON). Each round also times a 2048x2048 float32 matmul (best round
kept), so the achieved GFLOP/s reads as a fraction of what this machine's matmul reaches.
Like md4jax.main, it makes glibc reuse freed memory (md4jax.runtime.allocator) when the
config's reuse_freed_host_memory is set; --[no]reuse_freed_host_memory overrides it.
It splits the CPU into the config's cpu_devices devices as md4jax.main does
(--cpu_devices overrides it): the batch is then data parallel over them.

--profile adds where the time goes, each part compiled on its own and timed in
alternating rounds with the step: the network's forward pass (one sampler call
at the training batch), forward + backward of the loss, the optimizer with the
EMA, the step with jax.nn.dot_product_attention in place of md4jax's einsum
softmax, the step with the segment mask built (what a packed batch costs), and
the step without RoPE (a diagnostic: not the same model).

--trace adds the step's XLA ops from a jax.profiler trace, summed by what they
compute (classified from the compiled HLO): weight matmuls, attention matmuls,
layout copies and transposes, RoPE, exp (softmax, sigmoid, loss), other
elementwise and the rest, with each kind's share of their sum. An op's time is
its wall time on the thread that ran it, so the sum exceeds the step where ops
overlap on the two threads, and falls short of it by the gaps between ops.
"""

import collections
import contextlib
import glob
import json
import re
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.model import transformer as model_lib
from md4jax.runtime import allocator, sharding
from md4jax.training import objective, train
from md4jax.training import state as state_lib

# name: (config, batch, seq_len, layers, width, heads, mlp); None keeps the config's value.
SIZES = {
  "tiny": ("tiny", None, None, None, None, None, None),
  "default": ("default", None, None, None, None, None, None),
  # The default's variants: block diffusion, uniform noise, both (per-position adaLN time).
  "default_bd3": ("default:bd3", None, None, None, None, None, None),
  "default_uniform": ("default:uniform", None, None, None, None, None, None),
  "default_uniform_bd3": ("default:uniform_bd3", None, None, None, None, None, None),
  "text8": ("text8", 2, None, None, None, None, None),
  "4x256": ("text8", 16, 128, 4, 256, 4, 704),
  "6x384": ("text8", 16, 256, 6, 384, 6, 1024),
  "12x768": ("text8", 16, 256, 12, 768, 12, 2048),
}

_SIZE = flags.DEFINE_enum("size", "default", list(SIZES), "Model size.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Global batch; default: the size's.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per round, after compile and warm-up.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timing rounds; the best is reported.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 10, "Untimed steps after the compile step.")
_PROFILE = flags.DEFINE_bool(
  "profile", False, "Also time the parts of the step (see the docstring)."
)
_TRACE = flags.DEFINE_bool(
  "trace", False, "Also sum the step's traced XLA ops by kind (see the docstring)."
)
_REUSE_MEMORY = flags.DEFINE_bool(
  "reuse_freed_host_memory",
  None,
  "glibc keeps freed memory instead of faulting in fresh pages (md4jax.runtime.allocator); "
  "default: the config's reuse_freed_host_memory, as md4jax.main does.",
)
_CPU_DEVICES = flags.DEFINE_integer(
  "cpu_devices",
  None,
  "CPU: JAX devices the host is split into, the batch data parallel over them (0 = one); "
  "default: the config's cpu_devices, as md4jax.main does.",
)

_FLOP_FORMULA = (
  "3 * flops_per_token * tokens, flops_per_token = 2 * (N (4 D^2 + 3 D F) + D V) "
  "+ 4 N L D (md4jax.model.transformer.flops_per_token; backward = 2x forward)"
)


def benchmark_config(size: str, batch_size=None):
  """The config of a named size, on CPU-friendly float32 without scan or remat."""
  name, batch, seq_len, layers, width, heads, mlp = SIZES[size]
  config = config_lib.load_config(name)
  for key, value in (
    ("batch_size", batch_size or batch),
    ("data.seq_len", seq_len),
    ("model.num_layers", layers),
    ("model.model_dim", width),
    ("model.num_heads", heads),
    ("model.mlp_dim", mlp),
  ):
    if value is not None:
      section, _, field = key.rpartition(".")
      (config[section] if section else config)[field] = value
  if name == "text8":  # The paper config's accelerator settings do not help a CPU.
    config.model.dtype, config.model.scan_layers, config.model.remat = "float32", False, "none"
    # Fastest on a 2-core machine: a device per core and freed memory reused. Share of the matmul
    # rate (README's table): 4x256 0.41-0.45 -> 0.58-0.64, 6x384 0.47 -> 0.66, 12x768 0.55 -> 0.64.
    config.cpu_devices, config.reuse_freed_host_memory = 2, True
  return config


def matmul_reference(n: int = 2048):
  """(a jitted float32 n x n matmul, its argument, its FLOPs): this machine's matmul rate."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  matmul = jax.jit(lambda x: x @ a)
  matmul(a).block_until_ready()
  return matmul, (a,), 2 * n**3


def _parts(config, model, optimizer, mesh, state, batch):
  """{name: (compiled fn, args)} for the profile; each fn returns what it computes."""
  key = jax.random.key(0)
  rows = jnp.arange(config.batch_size)
  # The same rows with segment ids and positions (as a packed batch carries them): the model
  # builds the attention mask.
  shape = batch["tokens"].shape
  packed = dict(
    batch,
    **sharding.device_batch(
      {
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
      },
      mesh,
    ),
  )

  def loss_grads(params, batch):
    total = lambda p: objective.training_loss(
      p, batch, key, model=model, config=config, row_index=rows, num_rows=config.batch_size
    )[0].sum()
    return jax.value_and_grad(total)(params)

  def forward(params, tokens):
    return model.apply({"params": params}, tokens, None, None, None)

  def optimizer_ema(state, grads):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    decay = train.ema_decay_at(state.step, config.optimizer.ema_decay, config.optimizer.ema_warmup)
    ema = jax.tree.map(lambda e, p: e + (1.0 - decay) * (p - e), state.ema_params, params)
    return params, opt_state, ema

  def step(state, batch):
    with sharding.activation_rules(mesh):
      return train.train_step(state, batch, model=model, optimizer=optimizer, config=config)

  def compiled(fn, *args, **patches):
    # The replacements hold only while tracing and compiling.
    with mock.patch.multiple(model_lib, **patches) if patches else contextlib.nullcontext():
      return jax.jit(fn).lower(*args).compile(), args

  grads = jax.tree.map(jnp.zeros_like, state.params)
  jax_attention = lambda q, k, v, mask, causal: jax.nn.dot_product_attention(
    q, k, v, mask=mask, is_causal=causal
  )
  no_rope = lambda x, cos, sin: x
  return {
    "step": compiled(step, state, batch),
    "forward": compiled(forward, state.params, batch["tokens"]),
    "loss_forward_backward": compiled(loss_grads, state.params, batch),
    "optimizer_and_ema": compiled(optimizer_ema, state, grads),
    "step_jax_nn_attention": compiled(step, state, batch, softmax_attention=jax_attention),
    "step_segment_mask": compiled(step, state, packed),
    "step_without_rope": compiled(step, state, batch, rotate=no_rope),
  }


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$")


def op_kinds(hlo_text: str) -> dict[str, str]:
  """{instruction name: kind} for every instruction of a compiled HLO module (a trace names the
  entry computation's; a fusion's kind comes from the ops of the computation it calls)."""
  bodies, current, ops = {}, None, {}
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      current = bodies.setdefault(header.group(2), [])
      continue
    match = _INSTRUCTION.match(line)
    if match and current is not None:
      current.append((match.group(3), match.group(2)))
      ops[match.group(1)] = (match.group(3), match.group(2), line)

  def kind(op, shape, line):
    called = re.search(r"calls=%?([\w.\-]+)", line)
    inner = bodies.get(called.group(1), []) if called else []
    names = {op} | {name for name, _ in inner}
    dots = [s for name, s in [(op, shape)] + inner if name in ("dot", "convolution")]
    if dots:  # Attention's q.k and p.v are batched over heads: rank 4 and up.
      return "attention matmuls" if max(s.count(",") for s in dots) >= 3 else "weight matmuls"
    if names & {"cosine", "sine"}:
      return "rope"
    if names & {"transpose", "copy"}:
      return "copies and transposes"
    if names & {"exponential", "logistic", "tanh", "log"}:
      return "exp (softmax, sigmoid, loss)"
    if names & {"add", "multiply", "subtract", "divide", "select", "rsqrt", "maximum", "reduce"}:
      return "other elementwise"
    return "other"

  return {name: kind(*spec) for name, spec in ops.items()}


def traced_op_seconds(compiled, state, batch, steps: int) -> dict[str, float]:
  """Seconds per step of the compiled step's XLA ops by kind (op_kinds), from a trace."""
  kinds = op_kinds(compiled.as_text())
  state, metrics = compiled(state, batch)  # Warm-up; the step donates its state: rethread it.
  jax.block_until_ready(metrics)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    in_flight = []
    for _ in range(steps):
      state, metrics = compiled(state, batch)
      train.bound_in_flight(in_flight, metrics)
    jax.block_until_ready(metrics)
    jax.profiler.stop_trace()
    profile = jax.profiler.ProfileData.from_file(
      glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    )
  seconds = collections.Counter()
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in kinds:
          seconds[kinds[event.name]] += event.duration_ns / 1e9 / steps
  return dict(seconds.most_common())


def _seconds_per_call(fn, args, steps):
  start, in_flight = time.perf_counter(), []
  for _ in range(steps):
    out = fn(*args)
    train.bound_in_flight(in_flight, out)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def main(argv):
  del argv
  config = benchmark_config(_SIZE.value, _BATCH_SIZE.value)
  reuse = config.reuse_freed_host_memory if _REUSE_MEMORY.value is None else _REUSE_MEMORY.value
  reused_memory = reuse and allocator.reuse_freed_host_memory()  # Before JAX's threads start.
  config.cpu_devices = config.cpu_devices if _CPU_DEVICES.value is None else _CPU_DEVICES.value
  if config.cpu_devices:  # Before the backend starts.
    jax.config.update("jax_num_cpu_devices", config.cpu_devices)
  mesh = sharding.make_mesh(config)
  config_lib.validate_config(config, mesh.devices.size, mesh.devices.flat[0].platform)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  shape = (config.batch_size, config.data.seq_len)
  batches = [
    sharding.device_batch(
      sources.dense_batch(
        np.random.default_rng(i).integers(0, config.data.vocab_size, shape, dtype=np.int32)
      ),
      mesh,
    )
    for i in range(2)
  ]
  parts = {}
  if _PROFILE.value:  # On a copy: the train step donates (deletes) the state it is given.
    parts = _parts(config, model, optimizer, mesh, jax.tree.map(jnp.copy, state), batches[0])
  start = time.perf_counter()  # One compilation serves the timing and the trace.
  step_fn = (
    train.make_train_step(config, model, optimizer, mesh, state).lower(state, batches[0]).compile()
  )
  state, metrics = step_fn(state, batches[0])
  jax.block_until_ready(metrics)
  compile_seconds = time.perf_counter() - start
  traced = {}
  if _TRACE.value:  # On a copy of the state: the step donates the state it is given.
    traced = traced_op_seconds(step_fn, jax.tree.map(jnp.copy, state), batches[0], _STEPS.value)

  in_flight = []
  for i in range(_WARMUP_STEPS.value):
    state, metrics = step_fn(state, batches[i % 2])
    train.bound_in_flight(in_flight, metrics)
  jax.block_until_ready((state, metrics))

  matmul, matmul_args, matmul_flops = matmul_reference()
  step_seconds, matmul_seconds, part_seconds = [], [], {name: [] for name in parts}
  for _ in range(_ROUNDS.value):  # Alternating rounds: load changes hit every part alike.
    start = time.perf_counter()
    in_flight = []
    for i in range(_STEPS.value):
      state, metrics = step_fn(state, batches[i % 2])
      train.bound_in_flight(in_flight, metrics)
    jax.block_until_ready((state, metrics))
    step_seconds.append((time.perf_counter() - start) / _STEPS.value)
    matmul_seconds.append(_seconds_per_call(matmul, matmul_args, 10))
    for name, (fn, args) in parts.items():
      part_seconds[name].append(_seconds_per_call(fn, args, _STEPS.value))
  seconds = min(step_seconds)

  m = config.model
  tokens = config.batch_size * config.data.seq_len
  flops = (
    3
    * model_lib.flops_per_token(
      m.num_layers, m.model_dim, m.mlp_dim, config.data.seq_len, config.data.vocab_size
    )
    * tokens
  )
  achieved, peak = flops / seconds / 1e9, matmul_flops / min(matmul_seconds) / 1e9
  result = {
    "size": _SIZE.value,
    "model_type": m.type,
    "params": model_lib.count_params(state.params),
    "num_layers": m.num_layers,
    "model_dim": m.model_dim,
    "num_heads": m.num_heads,
    "mlp_dim": m.mlp_dim,
    "vocab_size": config.data.vocab_size,
    "batch_size": config.batch_size,
    "seq_len": config.data.seq_len,
    "reuse_freed_host_memory": reused_memory,
    "devices": f"{mesh.devices.size} x {jax.devices()[0].device_kind}",
    "compile_seconds": round(compile_seconds, 2),
    "warmup_steps": _WARMUP_STEPS.value,
    "timed_steps": _STEPS.value * _ROUNDS.value,
    "seconds_per_step": seconds,
    "seconds_per_step_rounds": step_seconds,
    "tokens_per_second": tokens / seconds,
    "achieved_gflops_per_second": achieved,
    "flop_formula": _FLOP_FORMULA,
    "matmul_f32_2048_gflops_per_second": peak,
    "achieved_over_matmul": achieved / peak,
  }
  if parts:
    result["profile_seconds"] = {name: min(times) for name, times in part_seconds.items()}
    result["profile_share_of_step"] = {
      name: min(times) / seconds for name, times in part_seconds.items()
    }
  if traced:
    result["traced_op_seconds_per_step"] = traced
    total = sum(traced.values())
    result["traced_op_share"] = {kind: value / total for kind, value in traced.items()}
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
