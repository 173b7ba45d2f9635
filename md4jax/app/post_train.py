"""--mode=post_train: a policy post-trained with a reward from post_train.init_from's params.

Each step reads batch_size prompts (the data's rows: conditional examples' prompts, or nothing
fixed), draws post_train.group_size rollouts of each with the sample.* sampler, scores them
with post_train.reward and updates the policy (`md4jax.posttraining.step`) against its frozen
reference, the init_from params. A bigram or exact_match reward runs inside the
step's one jitted program (rollouts, rewards, estimates, updates); a Python reward between a
rollout program and an update program. The step's key is a function of (config.seed, step), so a resumed run
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
from md4jax.posttraining import preferences
from md4jax.posttraining import rewards as rewards_lib
from md4jax.posttraining import rollouts as rollouts_lib
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
  if config.model.type != "mdm":
    raise ValueError(
      f"post_train needs a masked diffusion model, not model.type={config.model.type!r}."
    )
  if config.diffusion.process != "masked":
    raise ValueError(
      "post_train estimates log π with masked-process estimators; diffusion.process="
      f"{config.diffusion.process!r} is not supported yet."
    )
  if state_lib.block_size(config):
    raise ValueError(
      "post_train estimates log π of a whole-sequence masked diffusion model; block diffusion "
      f"(diffusion.block_size={config.diffusion.block_size}) is not supported yet."
    )
  if config.post_train.algorithm != "vrpo" and config.sample.temperature == 0:
    raise ValueError(
      "post_train rollouts at sample.temperature=0 are identical within a group: no advantage "
      "to learn from; sample at a temperature > 0."
    )
  if objective.is_learned(config):
    raise ValueError(
      f"post_train needs a fixed masking schedule, not diffusion.schedule="
      f"{config.diffusion.schedule!r} (its exponents would train with the policy)."
    )
  if (cfg.algorithm == "vrpo") != bool(cfg.pairs):
    raise ValueError(
      "post_train.pairs (a JSONL file of prompt/chosen/rejected) goes with "
      f"post_train.algorithm='vrpo' and only with it; got algorithm={cfg.algorithm!r}, "
      f"pairs={cfg.pairs!r}."
    )
  if cfg.algorithm == "vrpo" and not cfg.beta > 0:
    raise ValueError(
      f"post_train.algorithm='vrpo' needs post_train.beta > 0 (DPO's β), got {cfg.beta}."
    )
  if cfg.reward == "exact_match" and config.data.dataset != "conditional":
    raise ValueError(
      "post_train.reward='exact_match' compares rollouts with answers: it needs "
      f"data.dataset='conditional' (prompt/answer JSONL), not {config.data.dataset!r}."
    )


def _reference_params(config, run: modes.Run, step: int):
  """post_train.init_from's EMA params of checkpoint `step` on this run's mesh: the frozen
  reference of a resumed run."""
  source = load.load(
    config.post_train.init_from,
    step=step,
    mesh=run.mesh,
    role="post_train.init_from",
    check_config=False,
    log=lambda line: print(f"post_train.init_from: {line}"),
  )
  return jax.device_put(
    state_lib.starting_params(config, source.params, source.config),
    state_lib.state_shardings(run.abstract_state).params,
  )


def programs(config, model, optimizer, abstract_state, mesh, reward, eos_id=None):
  """The step: (state, prompts, reference) -> (state, metrics); reference: the frozen params, an
  argument (closed over, they would be constants baked into the program). One program for an
  in-program reward; else a rollout program, the host's reward and an update program. prompts:
  a data batch of batch_size rows, each rolled out post_train.group_size times
  (`posttraining.rollouts`); eos_id ends a rollout's generated span."""
  length, group_size = config.data.seq_len, config.post_train.group_size
  rows = config.batch_size * group_size
  # Unprompted rows start their blocks at 0; a prompt of any width decodes as one block (or the
  # model's own blocks): the offset of LLaDA's blocks is one per program.
  how = generate.decoding(config, model, length)
  kwargs = dict(generate.sampler_kwargs(config, None), **how, batch_size=rows, length=length)
  base_key = rng.stream(config.seed, "post_train")
  state_shardings = state_lib.state_shardings(abstract_state)
  replicated = sharding.replicated(mesh)

  def rollout(params, step, prompts):
    batch = rollouts_lib.grouped(prompts, group_size)
    fixed = rollouts_lib.prompt_mask(batch)
    denoiser = objective.sampling_denoiser(model, params, config)
    key = jax.random.fold_in(jax.random.fold_in(base_key, step), 0)
    with sharding.activation_rules(mesh):
      tokens, info = decoder.sample(
        key, denoiser, prompt=batch["tokens"], prompt_mask=fixed, eos_id=eos_id, **kwargs
      )
    span = rollouts_lib.generated_span(fixed, None if eos_id is None else info["lengths"])
    return {
      "tokens": tokens,
      "generated": span,
      "reference": batch["tokens"],
      "reference_editable": batch["editable"],
      "fixed": fixed,
    }

  def update(state, rollouts, rewards, reference):
    key = jax.random.fold_in(jax.random.fold_in(base_key, state.step), 1)
    segment_ids, positions = rollouts_lib.scored_inputs(rollouts["fixed"], rollouts["generated"])
    with sharding.activation_rules(mesh):
      return step_lib.update(
        state,
        rollouts["tokens"],
        rewards,
        rollouts["generated"],
        key,
        segment_ids,
        positions,
        model=model,
        optimizer=optimizer,
        config=config,
        reference_params=reference,
      )

  data, params = sharding.batch_sharding(mesh), state_shardings.params
  if reward.in_program:

    def fused(state, prompts, reference):
      rollouts = rollout(state.params, state.step, prompts)
      return update(state, rollouts, reward(rollouts), reference)

    return jax.jit(
      fused,
      in_shardings=(state_shardings, data, params),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0,
    )
  rollout_fn = jax.jit(rollout, in_shardings=(params, replicated, data), out_shardings=replicated)
  update_fn = jax.jit(
    update,
    in_shardings=(state_shardings, replicated, replicated, params),
    out_shardings=(state_shardings, replicated),
    donate_argnums=0,
  )

  def two_programs(state, prompts, reference):
    rollouts = rollout_fn(state.params, state.step, prompts)
    rewards = reward(sharding.to_host(rollouts))
    return update_fn(state, rollouts, rewards, reference)

  return two_programs


def preference_program(config, model, optimizer, abstract_state, mesh):
  """The DPO / VRPO step: (state, chosen rows, rejected rows, reference) -> (state, metrics)."""
  base_key = rng.stream(config.seed, "post_train")
  state_shardings = state_lib.state_shardings(abstract_state)
  data = sharding.batch_sharding(mesh)

  def step(state, chosen, rejected, reference):
    key = jax.random.fold_in(base_key, state.step)
    with sharding.activation_rules(mesh):
      return step_lib.preference_update(
        state,
        chosen,
        rejected,
        key,
        model=model,
        optimizer=optimizer,
        config=config,
        reference_params=reference,
      )

  return jax.jit(
    step,
    in_shardings=(state_shardings, data, data, state_shardings.params),
    out_shardings=(state_shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )


def _record(window: list[dict], groups: int) -> dict:
  """The window's means; the mean reward's standard error from the spread of the window's group
  means (a prompt's rollouts are not independent of each other)."""
  record = {name: float(np.mean([m[name] for m in window])) for name in window[0]}
  if "reward_group_std" in record:
    variance = np.mean([m["reward_group_std"] ** 2 for m in window])
    record["reward_stderr"] = float(math.sqrt(variance / (groups * len(window))))
  record["learning_rate"] = window[-1]["learning_rate"]
  return record


def _stepper(config, run: modes.Run, eos_id):
  """(step number, reference params) -> (state, metrics) of the run's algorithm, reading its own
  data; and the rows a step scores. Reads the pairs or the reward first: a bad one fails here."""
  cfg = config.post_train
  # The run's optimizer, its schedule counted in updates: updates_per_rollout of them a step.
  optimizer = state_lib.make_optimizer(config, cfg.updates_per_rollout)
  if cfg.algorithm == "vrpo":
    pairs = preferences.read_pairs(cfg.pairs, run.source.encode, eos_id, config.data.seq_len)
    program = preference_program(config, run.model, optimizer, run.abstract_state, run.mesh)

    def preference_step(step, reference):
      chosen, rejected = preferences.batch_at(pairs, step, config.batch_size, config.seed)
      return program(
        run.state,
        sharding.device_batch(chosen, run.mesh),
        sharding.device_batch(rejected, run.mesh),
        reference,
      )

    return preference_step, 2 * config.batch_size
  reward = rewards_lib.parse(cfg.reward, config.data.vocab_size)
  program = programs(config, run.model, optimizer, run.abstract_state, run.mesh, reward, eos_id)

  def rollout_step(step, reference):
    del step  # The prompts come from the data iterator, restored with the checkpoint.
    return program(run.state, sharding.device_batch(next(run.iterator), run.mesh), reference)

  return rollout_step, config.batch_size * cfg.group_size


def _progress(line, step, record, rows, seq_len, seconds):
  if "reward_mean" in record:
    figure, name = record["reward_mean"], "reward"
    extra = f" ± {record['reward_stderr']:.4f}"
    if "kl" in record:
      extra += f"  KL {record['kl']:.3f} (estimated)"
  else:
    figure, name = record["loss"], "preference loss"
    extra = f"  accuracy {record['preference_accuracy']:.3f}  margin {record['margin']:.3f}"
  line.update(step, figure, rows * seq_len / seconds, seconds, name=name, extra=extra)


def post_train(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=post_train (the module docstring): returns the last logged record."""
  config = config_lib.expand_preset(config)
  check_run(config)
  with modes.session(
    config, workdir, "post_train", restored=False, init_from_key="post_train.init_from"
  ) as (run, writer):
    config = run.config
    eos_id = run.source.tokenizer.eos_id if config.data.dataset == "conditional" else None
    if config.post_train.reward == "exact_match" and eos_id is None:
      raise ValueError(
        "post_train.reward='exact_match' needs a tokenizer with an EOS (data.tokenizer char, "
        "byte or bpe ends each response with one): without it no rollout's span ends."
      )
    step_fn, rows = _stepper(config, run, eos_id)
    # The reference is the checkpoint the policy started from: on a fresh run a copy of the
    # state's params (read once), on a resume that step read again (init_from may have newer).
    if run.restored_step is None:
      copied = jax.tree.map(jnp.copy, run.state.params)  # Not the donated state's buffers.
      reference = jax.device_put(copied, state_lib.state_shardings(run.abstract_state).params)
      reference_step = run.init_from_step
    else:
      reference_step = run.loop_state["reference_step"]
      reference = _reference_params(config, run, reference_step)
    run.begin(writer)
    start = int(sharding.to_host(run.state.step))
    line = progress.ProgressLine(config.num_train_steps, 0, config.checkpoint_every_steps)
    window, record, last_saved = list(run.loop_state["window"]), {}, run.restored_step
    started = time.perf_counter()
    with preemption.StopSignals() as stop:
      for step in range(start + 1, config.num_train_steps + 1):
        run.state, metrics = step_fn(step, reference)
        metrics = modes.host_metrics(metrics, "post_train", step, last_saved)
        window.append(metrics)
        is_last = step == config.num_train_steps
        stopping = not is_last and stop.stop_after(step)
        if step % config.log_every_steps == 0 or is_last:
          record = _record(window, config.batch_size)
          writer.write_train(step, record)
          seconds = (time.perf_counter() - started) / len(window)
          _progress(line, step, record, rows, config.data.seq_len, seconds)
          window, started = [], time.perf_counter()
        if step % config.checkpoint_every_steps == 0 or is_last or stopping:
          checkpoint.save(
            run.manager,
            step,
            run.state,
            run.iterator.get_state(),
            config,
            {"window": window, "reference_step": reference_step},
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
