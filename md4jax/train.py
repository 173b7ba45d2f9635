"""The trainer: one mesh over all local devices, one pure jitted train step, orbax resume.

A single device is a mesh of size 1. The batch is sharded on the "data" axis
and every state leaf gets its sharding from `state_partition_spec`, which
replicates for now: FSDP or tensor-parallel specs go there.
"""

import functools
import json
import math
import pathlib
import time
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from md4jax import checkpoint
from md4jax import config_lib
from md4jax import data
from md4jax import evaluate
from md4jax import frontier
from md4jax import generate
from md4jax import metrics_writer
from md4jax import model as model_lib
from md4jax import plots
from md4jax import report


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: Any
  opt_state: Any
  ema_params: Any  # Used for evaluation and sampling.
  rng: jax.Array  # Raw uint32 key; step k uses fold_in(rng, k).


def make_mesh(devices=None) -> Mesh:
  """A 1-D mesh with axis "data" over `devices` (default: all local devices)."""
  return Mesh(np.asarray(jax.local_devices() if devices is None else devices), ("data",))


def state_partition_spec(leaf) -> P:
  """Partition spec of one state leaf: replicated (the FSDP seam)."""
  del leaf
  return P()


def state_sharding(mesh: Mesh, state) -> Any:
  return jax.tree.map(lambda leaf: NamedSharding(mesh, state_partition_spec(leaf)), state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def build_model(config: ml_collections.ConfigDict) -> model_lib.Transformer:
  m = config.model
  return model_lib.Transformer(
      vocab_size=config.data.vocab_size, num_layers=m.num_layers, model_dim=m.model_dim,
      num_heads=m.num_heads, mlp_dim=m.mlp_dim, causal=m.type == "ar",
      time_conditioning=m.time_conditioning, dtype=jnp.dtype(m.dtype))


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine decay to 0 at the last step."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.optimizer.learning_rate,
      warmup_steps=config.optimizer.warmup_steps, decay_steps=config.num_train_steps, end_value=0.0)


def weight_decay_mask(params) -> Any:
  """True for matrices; norm scales, biases and other vectors are not decayed."""
  def decays(path, param):
    return param.ndim >= 2 and not any("norm" in str(getattr(k, "key", k)) for k in path)
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  opt = config.optimizer
  return optax.chain(
      optax.clip_by_global_norm(opt.grad_clip_norm),
      optax.adamw(learning_rate_schedule(config), b1=opt.b1, b2=opt.b2,
                  weight_decay=opt.weight_decay, mask=weight_decay_mask))


def init_state(config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh) -> TrainState:
  """A fresh TrainState, created directly with its shardings."""
  def init(rng):
    params_rng, step_rng = jax.random.split(rng)
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    params = model.init(params_rng, tokens, jnp.ones((1,)))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      ema_params=jax.tree.map(jnp.copy, params), rng=step_rng)

  rng = jax.random.PRNGKey(config.seed)
  shardings = state_sharding(mesh, jax.eval_shape(init, rng))
  return jax.jit(init, out_shardings=shardings)(rng)


def train_step(state: TrainState, batch: dict, *, model, optimizer,
               config: ml_collections.ConfigDict) -> tuple[TrainState, dict]:
  """One optimizer step on a batch (dict of [B, L]: tokens, segment_ids, positions). Pure."""
  key = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    nats = evaluate.sequence_nats(params, batch, key, model=model, config=config,
                                  estimator=config.training.estimator, t_sampling="stratified")
    # Per valid token, never per masked token (MATH.md, "Objective").
    return nats.sum() / jnp.maximum(batch["editable"].astype(jnp.int32).sum(), 1)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  decay = config.optimizer.ema_decay
  ema_params = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema_params, params)
  metrics = {
      "loss": loss,
      "nelbo_bits_per_token": loss / math.log(2.0),  # For "ar": the NLL in bits/token.
      "grad_norm": optax.tree.norm(grads),
      "learning_rate": learning_rate_schedule(config)(state.step),
  }
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            ema_params=ema_params)
  return new_state, metrics


def make_train_step(config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh, state: TrainState):
  """train_step jitted over `mesh`, donating the state."""
  shardings = state_sharding(mesh, state)
  step_fn = functools.partial(train_step, model=model, optimizer=optimizer, config=config)
  return jax.jit(step_fn, in_shardings=(shardings, batch_sharding(mesh)),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


class _Setup:
  """Everything the three modes share: mesh, data, model, state restored from the latest checkpoint."""

  def __init__(self, config: ml_collections.ConfigDict, workdir):
    self.mesh = make_mesh()
    config_lib.validate_config(config, self.mesh.size)
    self.config, self.workdir = config, pathlib.Path(workdir)
    self.source = data.make_source(config, workdir)
    self.model, self.optimizer = build_model(config), make_optimizer(config)
    self.state = init_state(config, self.model, self.optimizer, self.mesh)
    self.iterator = self.source.train_iterator()
    self.manager = checkpoint.make_manager(self.workdir, config.training.max_checkpoints_to_keep)
    restored = checkpoint.restore(self.manager, checkpoint.abstract_like(self.state))
    self.restored_step: Optional[int] = None
    if restored is not None:
      self.restored_step, self.state, data_state = restored
      self.iterator.set_state(data_state)

  def evaluate(self, writer: metrics_writer.MetricsWriter, final: bool = True) -> dict:
    """eval.json and eval.md; the final evaluation also draws the plots and, with a judge,
    scores the same rows and fresh samples under it."""
    # The per-t profile is a picture of the final model: periodic evaluations skip its cost.
    eval_fn = evaluate.make_eval_fn(self.config, self.model, self.mesh, with_profile=final)
    judge = (evaluate.Judge.from_workdir(self.config.eval.judge_workdir, self.mesh)
             if final and self.config.eval.judge_workdir else None)
    results = evaluate.evaluate(self.config, eval_fn, self.state.ema_params, self.source, self.mesh,
                                judge)
    if judge is not None:
      results.update(evaluate.judge_samples(self.config, self.model, self.state.ema_params,
                                            self.source, judge))
    step = int(self.state.step)
    writer.write_eval(step, results)
    if jax.process_index() == 0:
      report.write(self.workdir, {"step": step, **results})
      if final:
        plots.write_all(self.workdir)
    return results

  def sample(self, writer: metrics_writer.MetricsWriter) -> list[dict]:
    if self.config.sample.num_samples == 0:
      return []
    key = jax.random.fold_in(jax.random.PRNGKey(self.config.seed), 4)
    tokens, nfe, seconds, trajectory = generate.generate(
        self.config, self.model, self.state.ema_params, self.source, key,
        record_trajectory=self.config.sample.trajectory)
    records = generate.sample_records(tokens, self.source, int(self.state.step), self.config, nfe,
                                      seconds)
    writer.write_samples(records)
    if trajectory is not None and jax.process_index() == 0:
      generate.write_trajectory(self.workdir, trajectory, self.source,
                                mask_id=self.config.data.vocab_size, nfe=nfe)
    return records


def _check_finite(step_metrics: list[tuple[int, dict]], last_checkpoint: Optional[int]):
  for step, metrics in step_metrics:
    if not math.isfinite(metrics["loss"]):
      kept = (f"the last good checkpoint (step {last_checkpoint}) is kept" if last_checkpoint
              else "no checkpoint was saved")
      raise FloatingPointError(
          f"Loss is {metrics['loss']} at step {step}: stopping without saving this state; {kept}. "
          "Try a lower optimizer.learning_rate or optimizer.grad_clip_norm.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir) -> dict:
  """Trains (resuming from the latest checkpoint in workdir), then evaluates and samples."""
  setup = _Setup(config, workdir)
  start_step = int(setup.state.step)
  if setup.restored_step is not None:
    print(f"Resuming from the checkpoint of step {start_step} in {checkpoint.checkpoint_dir(workdir)}.")
  if jax.process_index() == 0:
    (setup.workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
  writer = metrics_writer.MetricsWriter(workdir, drop_records_after=start_step)
  try:
    setup.state = _train_loop(setup, writer)
    results = setup.evaluate(writer)
    records = setup.sample(writer)
  finally:
    setup.manager.wait_until_finished()  # A pending async save completes even on error.
    setup.iterator.close()
    writer.close()
  print(evaluate.summary(results))
  for record in records[:2]:
    print("sample:", record["text"])
  if records and "true_bits_per_token" in records[0]:
    sample_bits = np.mean([record["true_bits_per_token"] for record in records])
    print(f"samples: {sample_bits:.4f} bits/token under the true language "
          f"(mean over {len(records)}; the entropy is {results['true_bits_per_token']:.4f})")
  return results


def _train_loop(setup: _Setup, writer: metrics_writer.MetricsWriter) -> TrainState:
  """Steps to config.num_train_steps, logging, checkpointing and evaluating on schedule."""
  config, state = setup.config, setup.state
  start_step, last_checkpoint = int(state.step), setup.restored_step
  step_fn = make_train_step(config, setup.model, setup.optimizer, setup.mesh, state)
  progress = metrics_writer.ProgressLine(config.num_train_steps)
  unchecked, window = [], []  # Device metrics not yet fetched; fetched ones since the last log.
  window_start, timed_steps = time.perf_counter(), 0
  for step in range(start_step + 1, config.num_train_steps + 1):
    state, metrics = step_fn(state, evaluate.device_batch(next(setup.iterator), setup.mesh))
    unchecked.append((step, metrics))
    if step == start_step + 1:  # Compilation: keep it out of tokens/s.
      jax.block_until_ready(metrics)
      print(f"Compiled and ran the first step in {time.perf_counter() - window_start:.1f}s.")
      window_start = time.perf_counter()
    else:
      timed_steps += 1
    is_last = step == config.num_train_steps
    should_log = step % config.log_every_steps == 0 or is_last
    should_save = step % config.checkpoint_every_steps == 0 or is_last
    should_eval = step % config.eval_every_steps == 0 and not is_last  # The caller evaluates the last.
    if should_log or should_save or should_eval:
      # Every step's loss is checked before any save that includes it.
      fetched = jax.device_get(unchecked)
      unchecked = []
      _check_finite(fetched, last_checkpoint)
      window += [m for _, m in fetched]
    if should_log:
      elapsed = time.perf_counter() - window_start
      record = {name: float(np.mean([m[name] for m in window])) for name in window[0]}
      record["learning_rate"] = float(window[-1]["learning_rate"])
      record["tokens_per_second"] = (timed_steps * config.batch_size * config.data.seq_len / elapsed
                                     if timed_steps else 0.0)
      writer.write_train(step, record)
      progress.update(step, record["loss"], record["tokens_per_second"],
                      elapsed / timed_steps if timed_steps else 0.0)
      window, window_start, timed_steps = [], time.perf_counter(), 0
    if should_save:
      checkpoint.save(setup.manager, step, state, setup.iterator.get_state(), config)
      last_checkpoint = step
    if should_eval:
      eval_start = time.perf_counter()
      setup.state = state
      setup.evaluate(writer, final=False)
      window_start += time.perf_counter() - eval_start  # Keep evaluation out of tokens/s.
  progress.finish()
  return state


def _restored_setup(config: ml_collections.ConfigDict, workdir) -> _Setup:
  setup = _Setup(config, workdir)
  if setup.restored_step is None:
    raise FileNotFoundError(f"No checkpoint in {checkpoint.checkpoint_dir(workdir)}; "
                            "run --mode=train on this workdir first.")
  return setup


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=eval: evaluates the EMA params of the latest checkpoint into eval.json."""
  setup = _restored_setup(config, workdir)
  writer = metrics_writer.MetricsWriter(workdir)
  results = setup.evaluate(writer)
  writer.close()
  print(evaluate.summary(results))
  return results


def sample_checkpoint(config: ml_collections.ConfigDict, workdir) -> list[dict]:
  """--mode=sample: samples from the EMA params of the latest checkpoint into samples.jsonl."""
  setup = _restored_setup(config, workdir)
  writer = metrics_writer.MetricsWriter(workdir)
  records = setup.sample(writer)
  writer.close()
  for record in records:
    print(json.dumps({k: v for k, v in record.items() if k != "step"}))
  return records


def frontier_checkpoint(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=frontier: sweeps samplers of the latest checkpoint into frontier.json and its plot."""
  setup = _restored_setup(config, workdir)
  judge = (evaluate.Judge.from_workdir(config.eval.judge_workdir, setup.mesh)
           if config.eval.judge_workdir else None)
  results = frontier.run(config, setup.model, setup.state.ema_params, setup.source, judge)
  if jax.process_index() == 0:
    for path in frontier.write(workdir, results):
      print(f"Wrote {path}")
  return results
