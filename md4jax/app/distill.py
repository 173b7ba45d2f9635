"""--mode=distill: a few-step student of a diffusion LM (docs/distillation.md): SDTT for a masked
model, DUO's consistency distillation (DCD) for a uniform-state one.

The student starts at distill.init_from's EMA params. The run's num_train_steps are
distill.rounds rounds of equal length; round r's student (r = 1, 2, ...) learns two steps of
its teacher in one (`md4jax.posttraining.distillation`), so it samples in
distill.teacher_steps / 2^r steps. Round 1's teacher is init_from's network, or with
distill.teacher = "oracle" the exact denoiser of the generated language; each later round's is
the student's EMA params at the end of the round before, whose checkpoint is never deleted, so
a resumed run reads its teacher back. The step's key is a function of (config.seed, step): a
resumed run continues exactly as the uninterrupted one. Checkpoints, metrics.jsonl, the progress
line and training_curves.png are the trainer's; the samples at the end use sample.*.
"""

import json
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax import config as config_lib
from md4jax import rng
from md4jax.app import load, modes, plots
from md4jax.diffusion.denoiser import as_denoiser
from md4jax.posttraining import distillation
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective, preemption, progress
from md4jax.training import state as state_lib


def check_run(config: ml_collections.ConfigDict):
  """What --mode=distill needs beyond a valid config: ValueError naming the key."""
  cfg = config.distill
  if not cfg.init_from:
    raise ValueError("distill.init_from is empty: name the workdir whose params start the student.")
  needs = {
    "model.type": (config.model.type, "mdm"),
    "diffusion.block_size": (state_lib.block_size(config), 0),
    "model.self_condition": (config.model.self_condition, False),
  }
  for name, (value, wanted) in needs.items():
    if value != wanted:
      raise ValueError(
        f"distill (SDTT, DCD) distills a whole-sequence diffusion model's ancestral sampler: "
        f"it needs {name}={wanted!r}, got {value!r}."
      )
  if objective.is_learned(config):
    raise ValueError(
      f"distill needs a mask-rate schedule, not diffusion.schedule={config.diffusion.schedule!r}."
    )
  if cfg.teacher == "oracle" and config.data.dataset != "markov":
    raise ValueError(
      "distill.teacher='oracle' is the exact denoiser of a generated language: it needs "
      f"data.dataset='markov', not {config.data.dataset!r}."
    )
  if config.num_train_steps % cfg.rounds:
    raise ValueError(
      f"num_train_steps={config.num_train_steps} must be divisible by distill.rounds="
      f"{cfg.rounds}: the rounds are of equal length."
    )


# What a run's rounds and teachers are: a resume must keep them (the loop state records them).
_RUN_KEYS = ("num_train_steps", "distill.teacher_steps", "distill.rounds", "distill.teacher")
# What the starting model must share with the run: its process, schedule and time input.
_MODEL_KEYS = (
  "diffusion.process",
  "diffusion.schedule",
  "model.time_input",
  "model.self_condition",
)


def _check_init_from(config: ml_collections.ConfigDict):
  """distill.init_from's own config (an md4jax workdir's config.json) agrees with the run on what
  the distillation reads; ValueError naming the key otherwise."""
  path = workdir_lib.as_workdir(config.distill.init_from).config_json
  if not path.is_file():
    return  # md4jax.load reports a missing workdir when the run starts.
  saved = json.loads(path.read_text())
  for name in _MODEL_KEYS:
    section, key = name.split(".")
    if section not in saved or key not in saved[section]:
      continue  # Not an md4jax workdir's config (a Hugging Face folder's): nothing to compare.
    value = saved[section][key]
    if value != config[section][key]:
      raise ValueError(
        f"distill.init_from was trained with {name}={value!r}, but this run has "
        f"{config[section][key]!r}: distill a model with its own settings (configs/distill.py:"
        "uniform for a uniform-state model)."
      )


def _check_resume(config: ml_collections.ConfigDict, run: modes.Run):
  """A restored run continues the rounds it started: its checkpoints are a distillation's, of
  the same round lengths and teachers."""
  now = {name: config_lib.key_value(config, name) for name in _RUN_KEYS}
  if "distill" not in run.loop_state:
    raise ValueError(
      f"distill: the checkpoints in {run.workdir.checkpoints} are not a distillation run's; "
      "distill into a fresh workdir."
    )
  saved = run.loop_state["distill"]
  changed = [
    f"{name}={saved[name]!r} (now {now[name]!r})" for name in now if saved[name] != now[name]
  ]
  if changed:
    raise ValueError(
      f"distill: this workdir's run has {', '.join(changed)}: resume it with its own settings."
    )


def student_steps(config: ml_collections.ConfigDict, step: int) -> int:
  """The sampler steps of the student that optimizer step `step` (from 1) trains."""
  steps_per_round = config.num_train_steps // config.distill.rounds
  return config.distill.teacher_steps // 2 ** ((step - 1) // steps_per_round + 1)


def program(config, model, optimizer, abstract_state, mesh):
  """(state, batch, teacher, student_steps) -> (state, metrics), one jitted step; the teacher
  (a `Denoiser`: a network's params are its leaves) and the step count are arguments, so every
  round runs the same program."""
  base_key = rng.stream(config.seed, "distill")
  state_shardings = state_lib.state_shardings(abstract_state)

  def step(state, batch, teacher, steps):
    key = jax.random.fold_in(base_key, state.step)
    with sharding.activation_rules(mesh):
      return distillation.update(
        state,
        batch,
        key,
        teacher,
        student_steps=steps,
        model=model,
        optimizer=optimizer,
        config=config,
      )

  return jax.jit(
    step,
    out_shardings=(state_shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )


def _first_teacher(config, run: modes.Run):
  """Round 1's teacher: the oracle, or init_from's network (a copy of a fresh run's params; a
  resumed run reads init_from's checkpoint of the step it started from again)."""
  if config.distill.teacher == "oracle":
    language = run.source.language
    if config.diffusion.process == "uniform":
      return as_denoiser(language.uniform_denoise_fn())
    return as_denoiser(language.denoise_fn(config.data.vocab_size))
  if run.restored_step is None:
    return _teacher_of(config, run, run.state.params)
  source = load.load(
    config.distill.init_from,
    step=run.loop_state["init_from_step"],
    mesh=run.mesh,
    role="distill.init_from",
    check_config=False,
  )
  return _teacher_of(config, run, state_lib.starting_params(config, source.params, source.config))


def _round_teacher(config, run: modes.Run, round_end: int):
  """A later round's teacher read back: the student's EMA params at step round_end."""
  source = load.load(
    run.workdir, step=round_end, mesh=run.mesh, role="distill's round", check_config=False
  )
  return _teacher_of(config, run, source.params)


def _teacher_of(config, run: modes.Run, params):
  """The teacher `Denoiser` of params, a copy (the state's buffers are donated each step)."""
  copied = jax.device_put(
    jax.tree.map(jnp.copy, params), state_lib.state_shardings(run.abstract_state).params
  )
  return objective.sampling_denoiser(run.model, copied, config)


def distill(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=distill (the module docstring): returns the last logged record."""
  config = config_lib.expand_preset(config)
  check_run(config)
  _check_init_from(config)
  steps_per_round = config.num_train_steps // config.distill.rounds
  with modes.session(
    config,
    workdir,
    "distill",
    restored=False,
    init_from_key="distill.init_from",
    keep_period=steps_per_round,
  ) as (run, writer):
    config = run.config
    step_fn = program(config, run.model, run.optimizer, run.abstract_state, run.mesh)
    if run.restored_step is not None:
      _check_resume(config, run)
    # A fresh run's starting checkpoint, or the one its first checkpoint recorded.
    restored = run.restored_step is not None
    init_from_step = run.loop_state["init_from_step"] if restored else run.init_from_step
    run_settings = {name: config_lib.key_value(config, name) for name in _RUN_KEYS}
    start = int(sharding.to_host(run.state.step))
    teacher = None
    if start < config.num_train_steps:
      current_round = start // steps_per_round  # From 0.
      if current_round:
        teacher = _round_teacher(config, run, current_round * steps_per_round)
      else:
        teacher = _first_teacher(config, run)
    run.begin(writer)
    line = progress.ProgressLine(config.num_train_steps, 0, config.checkpoint_every_steps)
    window, record, last_saved = list(run.loop_state["window"]), {}, run.restored_step
    rows = config.batch_size * config.data.seq_len
    started = time.perf_counter()
    with preemption.StopSignals() as stop:
      for step in range(start + 1, config.num_train_steps + 1):
        steps = student_steps(config, step)
        batch = sharding.device_batch(next(run.iterator), run.mesh)
        run.state, metrics = step_fn(run.state, batch, teacher, jnp.int32(steps))
        metrics = modes.host_metrics(metrics, "distill", step, last_saved)
        window.append({**metrics, "student_steps": float(steps)})
        is_last = step == config.num_train_steps
        round_ends = step % steps_per_round == 0
        stopping = not is_last and stop.stop_after(step)
        if step % config.log_every_steps == 0 or is_last or round_ends:
          record = {name: float(np.mean([m[name] for m in window])) for name in window[0]}
          writer.write_train(step, record)
          seconds = (time.perf_counter() - started) / len(window)
          line.update(
            step,
            record["loss"],
            rows / seconds,
            seconds,
            name="distillation loss",
            extra=f"  student {steps} steps",
          )
          window, started = [], time.perf_counter()
        if step % config.checkpoint_every_steps == 0 or is_last or stopping or round_ends:
          checkpoint.save(
            run.manager,
            step,
            run.state,
            run.iterator.get_state(),
            config,
            {"window": window, "init_from_step": init_from_step, "distill": run_settings},
          )
          last_saved = step
        if stopping:
          print(f"Stopped after step {step}: its checkpoint is saved. Rerun to resume.")
          return record
        if round_ends and not is_last:  # The next round's teacher: this round's student.
          teacher = _teacher_of(config, run, run.state.ema_params)
    line.finish()
    if run.is_writer:
      plots.write_all(run.workdir, frontier=False)
    run.sample(writer)
  return record
