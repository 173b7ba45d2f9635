r"""MD4's own code and md4jax trained on the same batches and scored on the same held-out windows,
one JSON line per run: the per-step comparison of docs/md4_parity.md.

  python benchmarks/md4_side_by_side.py --md4_src=PATH --data=text8.zip --steps=300 \
      --runs=md4,preset,defaults,init,norm,gate,embedding,time,output,biases,clip,b2,loss_units,schedule

PATH is a checkout of google-deepmind/md4 (imported from there unchanged; packages it imports
but never calls here are stubbed, as in tests/golden/make_md4_golden.py). --data is text8 or
any text8-format file (split 90/5/5 by position, as md4jax reads it). The shape is MD4's
text8 network at a CPU size: 4 layers, width 192, 3 heads (MLP 512), 16 x 256 characters per
step, AdamW at 1e-3 after 200 warmup steps, cosine to 0 at --steps.

Runs:
  md4        MD4's own model and train step (md4/train.py), raw params at the end.
  preset     md4jax with model.preset=md4 and MD4's schedule (md4linear), endpoint terms,
             optimizer (b2 0.999, no clipping, EMA 0.9999 from step 0) and loss units (bits).
  defaults   md4jax's own defaults at this shape.
  defaults_zero_output  the defaults with MD4's zero-initialized output layer;
  defaults_fan_in_zero_output  and with MD4's fan-in init too.
  replay     the preset from MD4's init, with MD4's own draws of t and of the masks at every
             step (after md4 in the same --runs): MD4's run in md4jax, step for step.
  replay_reversed  replay with the rows of every batch (and their draws) in reverse order: the
             same math in another float order, so how far it moves from replay is the rounding
             alone, amplified by training.
  md4_init   the preset from MD4's init with md4jax's own draws (after md4).
  md4_draws  the preset from md4jax's own init with MD4's draws (after md4): with md4_init,
             which of the init and the draws decides a run.
The replays, md4_init and md4_draws need md4 earlier in --runs, or --md4_record of an earlier
md4 run.
  init, norm, gate, embedding, time, time_input, output, biases, clip, b2, loss_units,
  schedule   the preset with one choice moved to md4jax's default.
Every run trains on the same batches (md4jax's pipeline, seed 0) and is scored by md4jax's
evaluator (mask_count NELBO, --eval_draws draws, every validation window) — MD4's trained
params through md4jax.model.md4_params — in bits per character ± SE: the raw params (MD4's
EMA at 0.9999 has barely left the init in these steps), and md4jax's defaults' EMA too.
"""

import functools
import json
import pathlib
import pickle
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.evaluation import evaluate
from md4jax.model import md4_params
from md4jax.runtime import sharding
from md4jax.training import state as state_lib
from md4jax.training import train

_MD4_SRC = flags.DEFINE_string("md4_src", None, "A checkout of google-deepmind/md4 (run md4).")
_DATA = flags.DEFINE_string("data", None, "text8, text8.zip or a text8-format file.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of every run.")
_RUNS = flags.DEFINE_list(
  "runs", ["md4", "preset", "defaults"], "Runs, in order (module docstring)."
)
_EVAL_DRAWS = flags.DEFINE_integer("eval_draws", 4, "NELBO draws per held-out window.")
_MD4_RECORD = flags.DEFINE_string(
  "md4_record", None, "A file for md4's init, draws and losses: written by md4, read without it."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the init (md4jax runs) and of MD4's train state.")

NUM_LAYERS, MODEL_DIM, NUM_HEADS, BATCH_SIZE, SEQ_LEN = 4, 192, 3, 16, 256
LEARNING_RATE, WARMUP_STEPS = 1e-3, 200

# The preset with one choice moved to md4jax's default: (model keys, other keys).
ABLATIONS = {
  "init": ({"weight_init": "normal"}, {}),
  "norm": ({"norm": "rms", "norm_eps": 1e-6}, {}),
  "gate": ({"mlp": "swiglu"}, {}),
  "embedding": ({"embed_dim": 0}, {}),
  "time": ({"time_conditioning": "none"}, {}),
  "time_input": ({"time_input": "alpha", "time_features": "dit"}, {}),
  "output": ({"output_init": "normal"}, {}),
  "biases": ({"biases": False}, {}),
  "clip": ({}, {"optimizer.grad_clip_norm": 1.0}),
  "b2": ({}, {"optimizer.b2": 0.99}),
  "loss_units": ({}, {"training.loss_units": "nats"}),
  "schedule": ({}, {"diffusion.schedule": "linear", "diffusion.endpoint_terms": "sampled"}),
}


# md4jax's defaults with some of MD4's choices: model keys.
DEFAULTS_WITH = {
  "defaults_zero_output": {"output_init": "zeros"},
  "defaults_fan_in_zero_output": {"output_init": "zeros", "weight_init": "fan_in_mlp_depth"},
}

# The preset trained with parts of MD4's record: (MD4's init, MD4's draws, rows reversed).
FROM_MD4_RECORD = {
  "replay": (True, True, False),
  "replay_reversed": (True, True, True),
  "md4_init": (True, False, False),
  "md4_draws": (False, True, False),
}


def warmup_steps() -> int:
  return min(WARMUP_STEPS, _STEPS.value - 1)  # Short smoke runs too.


def base(data_path: str):
  config = config_lib.load_config("text8")
  config.seed, config.batch_size, config.num_train_steps = _SEED.value, BATCH_SIZE, _STEPS.value
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = _STEPS.value
  config.data.path, config.data.seq_len = data_path, SEQ_LEN
  model = config.model
  model.num_layers, model.model_dim, model.num_heads = NUM_LAYERS, MODEL_DIM, NUM_HEADS
  model.mlp_dim = config_lib.md4_mlp_dim(MODEL_DIM)
  model.dtype, model.scan_layers, model.remat = "float32", False, "none"
  config.optimizer.learning_rate, config.optimizer.warmup_steps = LEARNING_RATE, warmup_steps()
  config.eval.num_sequences, config.eval.batch_size = 100_000, 32  # Every validation window.
  config.eval.num_mc_samples, config.eval.estimator = _EVAL_DRAWS.value, "mask_count"
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  return config


def md4_like(config):
  """MD4's objective and optimizer around whatever network the config has."""
  config.diffusion.schedule, config.diffusion.endpoint_terms = "md4linear", "md4"
  config.optimizer.b2, config.optimizer.grad_clip_norm = 0.999, 0.0
  config.optimizer.ema_decay, config.optimizer.ema_warmup = 0.9999, False
  config.training.loss_units = "bits"
  return config


def run_config(name: str, data_path: str):
  config = base(data_path)
  if name == "defaults":
    return config
  if name in DEFAULTS_WITH:
    config.model.update(DEFAULTS_WITH[name])
    return config
  config = md4_like(config)
  if name == "preset":
    config.model.preset = "md4"
    return config_lib.expand_preset(config)
  model_keys, other_keys = ABLATIONS[name]
  config.model.preset = "md4"
  values = config_lib.preset_values(config)
  config.model.preset = "none"
  for key, value in {**values, **model_keys}.items():
    config.model[key] = value
  for key, value in other_keys.items():
    section, leaf = key.split(".")
    config[section][leaf] = value
  return config


def score(config, model, params, source, mesh) -> dict:
  eval_fn = evaluate.make_eval_fn(config, model, mesh, with_profile=False)
  result = evaluate.evaluate(config, eval_fn, params, source, mesh)
  return {
    "bits": result["nelbo_bits_per_token"],
    "stderr": result["nelbo_bits_per_token_stderr"],
    "windows": result["num_sequences"],
  }


def train_curve(losses) -> dict:
  """The training loss (bits/token) averaged over the last 50 steps, and over each 100 steps:
  when a run leaves the unigram plateau."""
  chunks = [float(np.mean(losses[i : i + 100])) for i in range(0, len(losses), 100)]
  return {"train_bits_last50": float(np.mean(losses[-50:])), "train_bits_per_100": chunks}


GAP_STEPS = (1, 10, 30, 60, 90, 120, 150, 200, 250, 300, 500, 1000)


def train_md4jax(
  config,
  batches,
  source,
  mesh,
  with_ema: bool,
  md4_run=None,
  md4_init=False,
  md4_draws=False,
  reverse=False,
):
  """md4_run (train_md4's record), to compare the losses with; md4_init: start from MD4's init;
  md4_draws: train on MD4's draws; reverse: with every batch's rows (and draws) reversed."""
  config_lib.validate_config(config, mesh.devices.size, "cpu")
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, mesh)
  if md4_init:
    params = as_md4jax(md4_run["init"])
    state = state.replace(
      params=params,
      opt_state=optimizer.init(params),
      ema_params=jax.tree.map(jnp.copy, params),
    )
  step = jax.jit(
    functools.partial(train.train_step, model=model, optimizer=optimizer, config=config)
  )
  start, losses = time.perf_counter(), []
  for index, batch in enumerate(batches):
    draws = None
    if md4_draws:
      t, masked = md4_run["draws"][index]
      draws = {"t": jnp.asarray(t), "masked": jnp.asarray(masked)}
    if reverse:
      batch, draws = jax.tree.map(lambda a: a[::-1], (batch, draws))
    state, metrics = step(state, batch, draws=draws)
    losses.append(float(metrics["nelbo_bits_per_token"]))
  seconds = time.perf_counter() - start
  scores = {"raw": score(config, model, state.params, source, mesh)}
  if with_ema:
    scores["ema"] = score(config, model, state.ema_params, source, mesh)
  result = {**scores, **train_curve(losses), "train_seconds": seconds}
  if md4_run is not None:
    gaps = np.abs(np.asarray(losses) - np.asarray(md4_run["losses"]))
    result["max_step_gap_to_md4"] = float(gaps.max())  # Bits per token, over every step.
    result["steps_within_1e-3_of_md4"] = int(np.argmax(np.append(gaps, np.inf) > 1e-3))
    # |loss − MD4's| at some steps: growing from float noise by a steady factor is chaos.
    result["gap_at_step"] = {k: float(gaps[k - 1]) for k in GAP_STEPS if k <= len(gaps)}
  return result


def as_md4jax(md4_params_tree):
  """MD4's params as md4jax's preset model's."""
  tree = md4_params.from_md4({"classifier": md4_params_tree["classifier"]}, NUM_HEADS)
  return jax.tree.map(jnp.asarray, tree)


def train_md4(data_path, batches, source, mesh) -> dict:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden"))
  import make_md4_golden  # pylint: disable=g-import-not-at-top

  make_md4_golden.install_stubs()
  sys.path.insert(0, str(pathlib.Path(_MD4_SRC.value).resolve()))
  import flax.jax_utils  # pylint: disable=g-import-not-at-top
  from md4 import train as md4_train  # pylint: disable=g-import-not-at-top
  from md4.configs.md4 import text8  # pylint: disable=g-import-not-at-top

  md4_config = text8.get_config()
  md4_config.n_layers, md4_config.num_heads = NUM_LAYERS, NUM_HEADS
  md4_config.feature_dim = MODEL_DIM // NUM_HEADS
  md4_config.data_shape, md4_config.batch_size = (SEQ_LEN,), BATCH_SIZE
  md4_config.learning_rate, md4_config.warmup_steps = LEARNING_RATE, warmup_steps()
  md4_config.num_train_steps = _STEPS.value
  lr_fn = functools.partial(
    md4_train.get_learning_rate,
    base_learning_rate=LEARNING_RATE,
    num_steps=_STEPS.value,
    warmup_steps=warmup_steps(),
    schedule_type=md4_config.learning_rate_schedule,
  )
  model, optimizer, state, metrics_class = md4_train.create_train_state(
    md4_config,
    jax.random.PRNGKey(_SEED.value),
    input_shape=(BATCH_SIZE, SEQ_LEN),
    schedule_fn=lr_fn,
  )
  step = make_md4_golden.pmapped_train_step(
    md4_train, model, optimizer, metrics_class, lr_fn, md4_config.ema_rate
  )
  read_draws = make_md4_golden.md4_draws_fn(model, config_lib.load_config("text8").data.vocab_size)
  init = state.params
  replicated = flax.jax_utils.replicate(state, devices=jax.local_devices()[:1])
  losses, draws, seconds = [], [], 0.0
  for batch in batches:
    tokens = jnp.asarray(batch["tokens"])
    current = flax.jax_utils.unreplicate(replicated)
    _, t, masked = read_draws(current.params, current.rng, tokens)  # Not timed.
    draws.append((np.asarray(t), np.asarray(masked)))
    start = time.perf_counter()
    replicated, metrics = step(train_state=replicated, batch={"text": tokens[None]})
    losses.append(float(flax.jax_utils.unreplicate(metrics)["loss"]))
    seconds += time.perf_counter() - start
  final = flax.jax_utils.unreplicate(replicated)
  config = run_config("preset", data_path)
  model_lib = state_lib.build_model(config)
  result = {
    "raw": score(config, model_lib, as_md4jax(final.params), source, mesh),
    **train_curve(losses),
    "train_seconds": seconds,
  }
  return result, {"init": init, "draws": draws, "losses": losses}


def main(argv):
  del argv
  data_path = _DATA.value
  config = base(data_path)
  mesh = sharding.make_mesh(config)
  workdir = tempfile.mkdtemp(prefix="md4_side_by_side_")
  source = sources.make_source(config, workdir)
  iterator = source.train_iterator()
  batches = [next(iterator) for _ in range(_STEPS.value)]
  md4_run = None
  if _MD4_RECORD.value and "md4" not in _RUNS.value:
    with open(_MD4_RECORD.value, "rb") as f:
      md4_run = pickle.load(f)
  for name in _RUNS.value:
    if name == "md4":
      result, md4_run = train_md4(data_path, batches, source, mesh)
      if _MD4_RECORD.value:
        with open(_MD4_RECORD.value, "wb") as f:
          pickle.dump(jax.tree.map(np.asarray, md4_run), f)
    elif name in FROM_MD4_RECORD:
      if md4_run is None:
        raise app.UsageError(f"--runs: {name} needs md4 before it (or --md4_record).")
      md4_init, md4_draws, reverse = FROM_MD4_RECORD[name]
      result = train_md4jax(
        run_config("preset", data_path),
        batches,
        source,
        mesh,
        False,
        md4_run=md4_run,
        md4_init=md4_init,
        md4_draws=md4_draws,
        reverse=reverse,
      )
    else:
      result = train_md4jax(
        run_config(name, data_path), batches, source, mesh, with_ema=name == "defaults"
      )
    print(json.dumps({"run": name, "steps": _STEPS.value, **result}), flush=True)


if __name__ == "__main__":
  flags.mark_flags_as_required(["data"])
  app.run(main)
