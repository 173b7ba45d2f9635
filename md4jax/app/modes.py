"""The workdir modes of `md4jax.main`: train (then evaluate and sample), eval, sample, frontier.

Each builds a `Run` (mesh, data, model, state restored from the workdir's
latest readable checkpoint) and writes its outputs where `md4jax.runtime.workdir`
says. Only process 0 writes JSON, Markdown and plots; orbax checkpoints are
written by every process (each saves its shards).

train, eval and sample hold the workdir's lock: a second one on the same
workdir is refused. frontier writes only frontier.json and plots/frontier.png,
which nothing else writes, so it may run beside training without the lock.
"""

import contextlib
import json
import math
import time
from typing import Iterator, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from md4jax import config as config_lib
from md4jax import rng
from md4jax.app import frontier, generate, judge, load, metrics_writer, plots, report
from md4jax.data import sources
from md4jax.data import tokenizer as tokenizer_lib
from md4jax.evaluation import evaluate
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import adaptation, checkpoint, preemption, train
from md4jax.training import state as state_lib


def _inherit_tokenizer(config, init_from, init_from_key: str, workdir: workdir_lib.Workdir):
  """A fresh run from init_from reads its text with init_from's saved tokenizer, the ids its
  params were trained on, not one built anew from this run's data (a char alphabet of other
  data would renumber the tokens): saved into the workdir, where the pipeline reuses it.
  data.tokenizer_path names another on purpose; generated data and text8 have fixed ids. A
  kind other than data.tokenizer's, or another tokenizer already in the workdir, is an error."""
  data, source = config.data, workdir_lib.as_workdir(init_from).tokenizer
  if data.dataset in ("markov", "text8") or data.tokenizer_path or not source.is_file():
    return
  inherited = tokenizer_lib.load(source)
  where = f"{init_from_key}={str(init_from)!r}"
  if inherited.kind != data.tokenizer:
    raise ValueError(
      f"{where} reads text with a {inherited.kind!r} tokenizer, not data.tokenizer="
      f"{data.tokenizer!r}: set data.tokenizer={inherited.kind!r} (the ids its params know) or "
      "name another in data.tokenizer_path."
    )
  if workdir.tokenizer.is_file():
    if _fingerprint(tokenizer_lib.load(workdir.tokenizer)) != _fingerprint(inherited):
      raise ValueError(
        f"{workdir.tokenizer} is not {where}'s tokenizer: remove it (this run has no "
        "checkpoint that used it) or start in a new workdir."
      )
    return
  inherited.save(workdir.root)
  print(
    f"{init_from_key}: reading the text with its {inherited.kind} tokenizer "
    f"({inherited.vocab_size} ids)."
  )


def _fingerprint(tokenizer) -> tuple:
  """What two tokenizers share when they number every token alike."""
  ids = np.arange(tokenizer.vocab_size)
  return tokenizer.kind, tokenizer.eos_id, tokenizer.vocab_size, tokenizer.decode(ids)


class Run:
  """What every mode shares: mesh, data, model, optimizer, and the state restored from the newest
  readable checkpoint of the workdir (or a fresh one).

  Before any data is read, a resumed config is checked against the checkpoint's: a change
  of what the checkpoint holds (the keys base_config declares fixed) fails, naming every key.
  data.vocab_size = 0 takes the tokenizer's size (`config` then holds it).
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir,
    init_from_key: str = "training.init_from",
    keep_period: Optional[int] = None,
  ):
    # The key naming the workdir a fresh run starts from (post-training's: post_train.init_from).
    section, key = init_from_key.split(".")
    self.init_from, self.init_from_key = config[section][key], init_from_key
    self.mesh = sharding.make_mesh(config)
    config_lib.validate_config(config, self.mesh.devices.size, self.mesh.devices.flat[0].platform)
    self.workdir = workdir_lib.as_workdir(workdir)
    if self.workdir.checkpoints.is_dir():  # Resuming: checked before any data is read.
      saved = checkpoint.newest_config(checkpoint.make_manager(self.workdir.checkpoints, 1))
      if saved is not None:
        config_lib.check_resume(saved, config, self.workdir.checkpoints)
    if self.init_from and not self.workdir.checkpoints.is_dir():
      _inherit_tokenizer(config, self.init_from, init_from_key, self.workdir)
    self.source = sources.make_source(
      config, self.workdir, shard=sharding.process_batch_shard(self.mesh, config.batch_size)
    )
    self.config = sources.with_vocab_size(config, self.source)
    self.manager = checkpoint.make_manager(
      self.workdir.checkpoints, config.training.max_checkpoints_to_keep, keep_period
    )
    self.model, self.optimizer, self.abstract_state = load.abstract_state(self.config, self.mesh)
    self.iterator = self.source.train_iterator()
    restored = checkpoint.restore(self.manager, self.abstract_state)
    self.restored_step: Optional[int] = None
    self.init_from_step: Optional[int] = None  # A fresh run's: the init_from checkpoint's step.
    self.loop_state: dict = {"window": []}
    if restored is None:  # A fresh run: a random init, or init_from's params.
      self.state = self._initial_state()
    else:
      self.restored_step, self.state, self.loop_state = (
        restored.step,
        restored.state,
        restored.loop_state,
      )
      self.iterator.set_state(restored.data_state)

  def _initial_state(self):
    """Step 0: a random init, or the EMA params of the init_from workdir (`md4jax.load`)."""
    config, init_from = self.config, self.init_from
    source = None
    if init_from:
      source = load.load(
        init_from,
        mesh=self.mesh,
        role=self.init_from_key,
        check_config=False,  # Only its params are used, laid out on this run's mesh.
        log=lambda line: print(f"init_from: {line}"),
      )
      self.init_from_step = source.step
    return adaptation.initial_state(
      config,
      self.model,
      self.optimizer,
      self.mesh,
      None if source is None else state_lib.starting_params(config, source.params, source.config),
      origin=source
      and f"step {source.step} in {workdir_lib.as_workdir(init_from).checkpoints} (model.type "
      f"{source.config.model.type!r}, now {config.model.type!r})",
      role=self.init_from_key,
      path=init_from,
    )

  def begin(self, writer: metrics_writer.MetricsWriter):
    """A run's outputs as it starts: records past its checkpoint dropped, config.json written."""
    writer.drop_records_after(self.restored_step or 0)
    if self.restored_step is not None:
      print(
        f"Resuming from the checkpoint of step {self.restored_step} in {self.workdir.checkpoints}."
      )
    if self.is_writer:
      self.workdir.config_json.write_text(self.config.to_json_best_effort(indent=2) + "\n")

  @property
  def is_writer(self) -> bool:
    return jax.process_index() == 0

  def evaluate(self, writer: metrics_writer.MetricsWriter, final: bool = True) -> dict:
    """eval.json and eval.md; the final evaluation also draws the plots and, with a judge,
    scores the same rows and fresh samples under it."""
    # Periodic evaluations score the headline bound only: the other bounds, the discrete-T
    # table and the per-t profile are pictures of the final model and cost as much again each.
    eval_fn = evaluate.make_eval_fn(
      self.config, self.model, self.mesh, with_profile=final, headline_only=not final
    )
    scorer = (
      judge.from_workdir(self.config.eval.judge_workdir, self.mesh)
      if final and self.config.eval.judge_workdir
      else None
    )
    results = evaluate.evaluate(
      self.config, eval_fn, self.state.ema_params, self.source, self.mesh, scorer
    )
    if scorer is not None:
      results.update(
        judge.judge_samples(self.config, self.model, self.state.ema_params, self.source, scorer)
      )
    step = int(sharding.to_host(self.state.step))
    writer.write_eval(step, results)
    if self.is_writer:
      report.write(self.workdir, {"step": step, **results})
      if final:
        plots.write_all(self.workdir, frontier=False)  # frontier.png belongs to --mode=frontier.
    return results

  def sample(self, writer: metrics_writer.MetricsWriter) -> list[dict]:
    if self.config.sample.num_samples == 0:
      return []
    key = rng.stream(self.config.seed, "sample")
    tokens, nfe, seconds, trajectory = generate.generate(
      self.config,
      self.model,
      self.state.ema_params,
      self.source,
      key,
      record_trajectory=self.config.sample.trajectory,
    )
    step = int(sharding.to_host(self.state.step))
    records = generate.sample_records(tokens, self.source, step, self.config, nfe, seconds)
    writer.write_samples(records)
    if trajectory is not None and self.is_writer:
      generate.write_trajectory(
        self.workdir, trajectory, self.source, mask_id=self.config.data.vocab_size, nfe=nfe
      )
    return records

  def close(self):
    try:
      checkpoint.wait(self.manager)  # A pending async save completes even on error.
    finally:
      self.iterator.close()


def host_metrics(metrics: dict, mode: str, step: int, last_saved: Optional[int]) -> dict:
  """A step's metrics as floats on the host; FloatingPointError naming the kept checkpoint if one
  is not finite (the step's state is then never saved)."""
  metrics = {name: float(value) for name, value in sharding.to_host(metrics).items()}
  if not all(math.isfinite(v) for v in metrics.values()):
    kept = f"step {last_saved}'s checkpoint is kept" if last_saved else "no checkpoint was saved"
    raise FloatingPointError(
      f"{mode}: a metric is not finite at step {step} ({metrics}); stopping without saving it: "
      f"{kept}. Try a lower optimizer.learning_rate."
    )
  return metrics


@contextlib.contextmanager
def _lock(workdir, mode: str) -> Iterator[None]:
  """The workdir's lock, taken by process 0 for the whole run; every process fails if it cannot."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = workdir_lib.Lock(workdir, mode).__enter__()
    except workdir_lib.WorkdirError as e:
      error = e
  if jax.process_count() > 1 and not multihost_utils.broadcast_one_to_all(np.int32(error is None)):
    error = error or workdir_lib.WorkdirError(
      f"Process 0 could not take the lock of {workdir} (its output says why)."
    )
  if error is not None:
    raise error
  try:
    yield
  finally:
    if lock is not None:
      lock.__exit__(None, None, None)


@contextlib.contextmanager
def session(
  config: ml_collections.ConfigDict,
  workdir,
  mode: str,
  *,
  restored: bool,
  init_from_key: str = "training.init_from",
  keep_period: Optional[int] = None,
) -> Iterator[tuple[Run, metrics_writer.MetricsWriter]]:
  """(run, writer) under the workdir's lock; restored=True requires a checkpoint.
  init_from_key: the config key naming the workdir a fresh run starts from; keep_period: steps
  whose checkpoints are never deleted (`checkpoint.make_manager`)."""
  with _lock(workdir, mode):
    run = Run(config, workdir, init_from_key, keep_period)
    try:
      if restored and run.restored_step is None:
        raise FileNotFoundError(
          f"No checkpoint in {run.workdir.checkpoints}; run --mode=train on this workdir first."
        )
      writer = metrics_writer.MetricsWriter(run.workdir)
      try:
        yield run, writer
      finally:
        writer.close()
    finally:
      run.close()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir) -> Optional[dict]:
  """Trains (resuming from the latest checkpoint in workdir), then evaluates and samples.

  A SIGTERM or Ctrl-C stops after the step in flight with a checkpoint of it: returns None.
  """
  config = config_lib.expand_preset(config)
  started = time.perf_counter()
  with session(config, workdir, "train", restored=False) as (run, writer):
    config = run.config  # data.vocab_size resolved.
    run.begin(writer)
    step_fn = train.make_train_step(config, run.model, run.optimizer, run.mesh, run.abstract_state)
    axes = ", ".join(f"{name}={size}" for name, size in run.mesh.shape.items())
    print(
      f"Training on {run.mesh.devices.size} {run.mesh.devices.flat[0].platform} device(s): {axes}."
    )

    def evaluate_now(state):
      run.state, start = state, time.perf_counter()
      results = run.evaluate(writer, final=False)
      print(
        f"evaluation at step {int(sharding.to_host(state.step))}: NELBO "
        f"{results['nelbo_bits_per_token']:.4f} ± {results['nelbo_bits_per_token_stderr']:.4f} "
        f"bits/token ({time.perf_counter() - start:.1f}s)",
        flush=True,
      )

    setup_done = time.perf_counter()
    with preemption.StopSignals() as stop:
      run.state, stopped = train.train_loop(
        config,
        run.state,
        step_fn,
        run.iterator,
        run.mesh,
        run.manager,
        writer,
        last_checkpoint=run.restored_step,
        window=run.loop_state["window"],
        stop=stop,
        evaluate_fn=evaluate_now,
      )
    if stopped:
      step = int(sharding.to_host(run.state.step))
      print(
        f"Stopped after step {step} ({stop.received or 'a SIGTERM to one of the processes'}): its "
        f"checkpoint is saved in {run.workdir.checkpoints}. Rerun the same command to resume."
      )
      return None
    trained = time.perf_counter()
    results = run.evaluate(writer)
    evaluated = time.perf_counter()
    records = run.sample(writer)
  print(evaluate.summary(results))
  # Where the wall time went: the loop's first step includes its compilation (printed above).
  print(
    f"Wall time {time.perf_counter() - started:.0f}s: setup {setup_done - started:.1f}s, "
    f"training {trained - setup_done:.1f}s, final evaluation {evaluated - trained:.1f}s, "
    f"sampling {time.perf_counter() - evaluated:.1f}s."
  )
  for record in records[:2]:
    print("sample:", record["text"])
  if records and "true_bits_per_token" in records[0]:
    sample_bits = np.mean([record["true_bits_per_token"] for record in records])
    print(
      f"samples: {sample_bits:.4f} bits/token under the true language "
      f"(mean over {len(records)}; the entropy is {results['true_bits_per_token']:.4f})"
    )
  return results


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=eval: evaluates the EMA params of the latest checkpoint into eval.json."""
  config = config_lib.expand_preset(config)
  with session(config, workdir, "eval", restored=True) as (run, writer):
    results = run.evaluate(writer)
  print(evaluate.summary(results))
  return results


def sample_checkpoint(config: ml_collections.ConfigDict, workdir) -> list[dict]:
  """--mode=sample: samples from the EMA params of the latest checkpoint into samples.jsonl."""
  config = config_lib.expand_preset(config)
  with session(config, workdir, "sample", restored=True) as (run, writer):
    records = run.sample(writer)
  for record in records:
    print(json.dumps({k: v for k, v in record.items() if k != "step"}))
  return records


def frontier_checkpoint(config: ml_collections.ConfigDict, workdir) -> dict:
  """--mode=frontier: sweeps samplers of the latest checkpoint into frontier.json and its plot.

  Takes no lock: it writes only files no other mode writes, so it may run beside training."""
  config = config_lib.expand_preset(config)
  run = Run(config, workdir)
  try:
    if run.restored_step is None:
      raise FileNotFoundError(
        f"No checkpoint in {run.workdir.checkpoints}; run --mode=train on this workdir first."
      )
    scorer = (
      judge.from_workdir(config.eval.judge_workdir, run.mesh) if config.eval.judge_workdir else None
    )
    results = frontier.run(run.config, run.model, run.state.ema_params, run.source, scorer)
    if run.is_writer:
      for path in frontier.write(run.workdir, results):
        print(f"Wrote {path}")
  finally:
    run.close()
  return results
