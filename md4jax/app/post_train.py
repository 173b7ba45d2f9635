"""--mode=post_train: a policy post-trained with a reward from post_train.init_from's params.

Each step draws batch_size rollouts with the sample.* sampler (groups of post_train.group_size),
scores them with post_train.reward and updates the policy (`md4jax.posttraining.step`) against
its frozen reference, the init_from params. A bigram reward runs inside the step's one jitted
program (rollouts, rewards, estimates, updates); a Python reward between a rollout program and
an update program. The step's key is a function of (config.seed, step), so a resumed run
continues exactly as the uninterrupted one. Checkpoints, metrics.jsonl, the progress line and
training_curves.png are the trainer's.
"""

import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax import config as config_lib
from md4jax import rng
from md4jax.app import generate, load, modes, plots
from md4jax.posttraining import rewards as rewards_lib
from md4jax.posttraining import step as step_lib
from md4jax.runtime import sharding
from md4jax.sampling import decoder
from md4jax.training import checkpoint, objective, preemption, progress
from md4jax.training import state as state_lib


def check_run(config: ml_collections.ConfigDict):
  """What --mode=post_train needs beyond a valid config: ValueError naming the key."""
  cfg = config.post_train
  if not cfg.init_from:
    raise ValueError(
      "post_train.init_from is empty: name the workdir whose params start the policy."
    )
  if config.batch_size % cfg.group_size:
    raise ValueError(
      f"batch_size={config.batch_size} is not a multiple of post_train.group_size="
      f"{cfg.group_size}: the rollouts come in whole groups."
    )
  if config.model.type != "mdm":
    raise ValueError(
      f"post_train needs a masked diffusion model, not model.type={config.model.type!r}."
    )


def _reference_params(config, run: modes.Run):
  """post_train.init_from's EMA params on this run's mesh: the frozen reference."""
  source = load.load(
    config.post_train.init_from,
    mesh=run.mesh,
    role="post_train.init_from",
    check_config=False,
    log=lambda line: print(f"post_train.init_from: {line}"),
  )
  return jax.device_put(
    state_lib.starting_params(config, source.params, source.config),
    state_lib.state_shardings(run.abstract_state).params,
  )


def _programs(config, run: modes.Run, reward, reference):
  """The step: (state) -> (state, metrics), one program for an in-program reward; else a rollout
  program, the host's reward and an update program."""
  length = config.data.seq_len
  how = generate.decoding(config, run.model, length)
  kwargs = dict(
    generate.sampler_kwargs(config, reference), **how, batch_size=config.batch_size, length=length
  )
  base_key = rng.stream(config.seed, "post_train")
  editable = jnp.ones((config.batch_size, length), bool)  # Unconditional rollouts: every token.
  state_shardings = state_lib.state_shardings(run.abstract_state)
  replicated = sharding.replicated(run.mesh)

  def rollout(params, step):
    key = jax.random.fold_in(base_key, step)
    denoiser = objective.sampling_denoiser(run.model, params, config)
    tokens, _ = decoder.sample(jax.random.fold_in(key, 0), denoiser, **kwargs)
    return tokens

  def update(state, tokens, rewards):
    key = jax.random.fold_in(jax.random.fold_in(base_key, state.step), 1)
    with sharding.activation_rules(run.mesh):
      return step_lib.update(
        state,
        tokens,
        rewards,
        editable,
        key,
        model=run.model,
        optimizer=run.optimizer,
        config=config,
        reference_params=reference,
      )

  if reward.in_program:

    def fused(state):
      tokens = rollout(state.params, state.step)
      return update(state, tokens, reward(tokens))

    return jax.jit(
      fused,
      in_shardings=(state_shardings,),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0,
    )
  rollout_fn = jax.jit(rollout, out_shardings=replicated)
  update_fn = jax.jit(
    update,
    in_shardings=(state_shardings, replicated, replicated),
    out_shardings=(state_shardings, replicated),
    donate_argnums=0,
  )

  def two_programs(state):
    tokens = rollout_fn(state.params, state.step)
    return update_fn(state, tokens, reward(np.asarray(sharding.to_host(tokens))))

  return two_programs


def _record(window: list[dict], rows: int) -> dict:
  """The window's means; the reward's standard error over every rollout in it."""
  record = {name: float(np.mean([m[name] for m in window])) for name in window[0]}
  variance = np.mean([m["reward_std"] ** 2 for m in window])
  record["reward_stderr"] = float(math.sqrt(variance / (rows * len(window))))
  record["learning_rate"] = window[-1]["learning_rate"]
  return record


def post_train(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=post_train (the module docstring): returns the last logged record."""
  config = config_lib.expand_preset(config)
  check_run(config)
  with modes.session(
    config, workdir, "post_train", restored=False, init_from_key="post_train.init_from"
  ) as (run, writer):
    config = run.config
    reward = rewards_lib.parse(config.post_train.reward, config.data.vocab_size)
    writer.drop_records_after(run.restored_step or 0)
    if run.restored_step is not None:
      print(
        f"Resuming from the checkpoint of step {run.restored_step} in {run.workdir.checkpoints}."
      )
    if run.is_writer:
      run.workdir.config_json.write_text(config.to_json_best_effort(indent=2) + "\n")
    step_fn = _programs(config, run, reward, _reference_params(config, run))
    start = int(sharding.to_host(run.state.step))
    line = progress.ProgressLine(config.num_train_steps, 0, config.checkpoint_every_steps)
    window, record, last_saved = list(run.loop_state["window"]), {}, run.restored_step
    started = time.perf_counter()
    with preemption.StopSignals() as stop:
      for step in range(start + 1, config.num_train_steps + 1):
        run.state, metrics = step_fn(run.state)
        metrics = {name: float(value) for name, value in sharding.to_host(metrics).items()}
        if not all(math.isfinite(v) for v in metrics.values()):
          kept = (
            f"step {last_saved}'s checkpoint is kept" if last_saved else "no checkpoint was saved"
          )
          raise FloatingPointError(
            f"post_train: a metric is not finite at step {step} ({metrics}); stopping without "
            f"saving it: {kept}. Try a lower optimizer.learning_rate."
          )
        window.append(metrics)
        is_last = step == config.num_train_steps
        stopping = not is_last and stop.stop_after(step)
        if step % config.log_every_steps == 0 or is_last:
          record = _record(window, config.batch_size)
          writer.write_train(step, record)
          seconds = (time.perf_counter() - started) / len(window)
          line.update(
            step,
            record["reward_mean"],
            config.batch_size * config.data.seq_len / seconds,
            seconds,
            name="reward",
            extra=f" ± {record['reward_stderr']:.4f}  KL {record['kl']:.3f} (estimated)",
          )
          window, started = [], time.perf_counter()
        if step % config.checkpoint_every_steps == 0 or is_last or stopping:
          checkpoint.save(
            run.manager, step, run.state, run.iterator.get_state(), config, {"window": window}
          )
          last_saved = step
        if stopping:
          print(f"Stopped after step {step}: its checkpoint is saved. Rerun to resume.")
          return record
    line.finish()
    if run.is_writer:
      plots.write_all(run.workdir, frontier=False)
    run.sample(writer)
  return record
