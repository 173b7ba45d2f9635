"""The train step and the training loop: one pure jitted step over a mesh of any size.

`train_step(state, batch) -> (state, metrics)` is pure; `make_train_step`
jits it with the state's shardings (params, optimizer state and EMA as
`md4jax.runtime.sharding` lays them out) and the batch split over data × fsdp, and
donates the old state. With training.grad_accum_steps = k the step sums the
gradients of k microbatches before the one update, which equals the step on
the whole batch: every row's random draws come from its global row index.
"""

import math
import time
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from md4jax.runtime import sharding
from md4jax.training import adaptation, checkpoint, objective, preemption, progress
from md4jax.training import state as state_lib

TrainState = state_lib.TrainState

# Steps dispatched ahead of the one last finished: two keep the devices busy while the host
# prepares the next batch. On a CPU mesh of several devices, a few dozen queued steps
# deadlock XLA:CPU's in-process all-reduce (it aborts the run after 40 s).
MAX_STEPS_IN_FLIGHT = 2


def bound_in_flight(in_flight: list, outputs) -> None:
  """Appends a dispatched call's outputs; waits for the oldest once more than
  MAX_STEPS_IN_FLIGHT are queued (and drops it from the list)."""
  in_flight.append(outputs)
  if len(in_flight) > MAX_STEPS_IN_FLIGHT:
    jax.block_until_ready(in_flight.pop(0))


def _microbatches(batch: dict, num: int) -> tuple[dict, jax.Array]:
  """[num, B/num, ...] microbatches and their global row indices [num, B/num].

  Microbatch j holds rows j, j + num, j + 2·num, ...: every device keeps its
  share of each microbatch, so no rows move between devices.
  """
  rows = jax.tree.leaves(batch)[0].shape[0]
  split = lambda x: x.reshape(rows // num, num, *x.shape[1:]).swapaxes(0, 1)
  micro = jax.tree.map(
    lambda x: nn.with_logical_constraint(split(x), (None, "batch") + (None,) * (x.ndim - 1)), batch
  )
  return micro, split(jnp.arange(rows))


def ema_decay_at(step: jax.Array, decay: float, warmup: bool = True):
  """The EMA decay of the update after `step` optimizer steps: min(decay, (1 + step) / (10 + step)),
  or `decay` itself from step 0 without the warm-up (MD4's; config.optimizer.ema_warmup).

  The warm-up keeps the random init from lingering in the EMA (with a fixed 0.999 it would
  still hold 37% of it after 1,000 steps): after n steps its weight is Π (1 + k) / (10 + k)
  = 9! n! / (n + 9)! (1e-5 after 10 steps) until the rate reaches `decay`.
  """
  if not warmup:
    return decay  # A Python float: 1 − decay is then exact before it is rounded to float32.
  return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


def _flat_aux(value_and_grad_output):
  """((loss, nats), grads) -> (nats, grads): the NELBO is what is reported, never the surrogate."""
  (_, nats), grads = value_and_grad_output
  return nats, grads


def train_step(
  state: TrainState,
  batch: dict,
  *,
  model,
  optimizer,
  config: ml_collections.ConfigDict,
  draws: Optional[dict] = None,
) -> tuple[TrainState, dict]:
  """One optimizer step on a batch (dict of [B, L]: tokens, segment_ids, positions, editable;
  segment_ids and positions may be None, `md4jax.data.sources`). Pure.

  draws ({"t": [B], "masked": [B, L] bool}, mdm with a mask-rate schedule): the times and
  masked positions of the loss, instead of the step's own draws, to replay another
  implementation's training (tests/test_md4_parity.py).
  """
  key = jax.random.fold_in(state.rng, state.step)
  num_rows = batch["tokens"].shape[0]
  attention_mask = adaptation.annealed_attention(key, state.step, config)  # None: not annealed.

  # Only what trains is differentiated (a LoRA run's adapters: no gradient of a frozen kernel
  # is ever computed or held); without LoRA, every param.
  trainable, frozen = state_lib.split_trainable(state.params, config)

  def total_nats(
    trainable, rows: dict, row_index: jax.Array, row_draws
  ) -> tuple[jax.Array, jax.Array]:
    # (differentiated loss, reported NELBO): equal in value (objective.training_loss).
    loss, nats = objective.training_loss(
      state_lib.join_trainable(trainable, frozen),
      rows,
      key,
      model=model,
      config=config,
      row_index=row_index,
      num_rows=num_rows,
      draws=row_draws,
      attention_mask=attention_mask,
    )
    return loss.sum(), nats.sum()

  grad_fn = lambda *args: _flat_aux(jax.value_and_grad(total_nats, has_aux=True)(*args))
  num_micro = config.training.grad_accum_steps
  if num_micro == 1:
    total, grads = grad_fn(trainable, batch, jnp.arange(num_rows), draws)
  else:

    def accumulate(carry, inputs):
      value, grads = grad_fn(trainable, *inputs)
      return jax.tree.map(jnp.add, carry, (value, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, trainable))
    # Accumulates (reported NELBO, grads).
    micro_draws = None if draws is None else _microbatches(draws, num_micro)[0]
    (total, grads), _ = jax.lax.scan(
      accumulate, zeros, (*_microbatches(batch, num_micro), micro_draws)
    )
  # Per valid token, never per masked token (docs/math.md, "Per-token figures").
  num_tokens = jnp.maximum(batch["editable"].astype(jnp.int32).sum(), 1)
  loss = total / num_tokens
  # The gradient of the loss in training.loss_units: bits are nats / ln 2 (MD4's; only Adam's
  # eps and the clip threshold see the difference).
  per_unit = num_tokens * (math.log(2.0) if config.training.loss_units == "bits" else 1.0)
  grads = jax.tree.map(lambda g: g / per_unit, grads)
  # The optimizer takes the whole tree; a frozen param's zero gradient is dropped unread
  # (its update is zero: state.make_optimizer), so XLA never materializes it.
  full_grads = state_lib.join_trainable(grads, jax.tree.map(jnp.zeros_like, frozen))
  updates, opt_state = optimizer.update(full_grads, state.opt_state, state.params)
  # Frozen params are passed through as they are, bit for bit.
  trained = optax.apply_updates(trainable, state_lib.split_trainable(updates, config)[0])
  params = state_lib.join_trainable(trained, frozen)
  decay = ema_decay_at(state.step, config.optimizer.ema_decay, config.optimizer.ema_warmup)
  # e + (1 − d)(p − e), not d e + (1 − d) p: at d near 1 the increment is small and rounds
  # relative to itself, where d e rounds relative to e (0.9999 for 300 steps: 5e-6 vs 2e-7).
  # A frozen param's EMA is the param itself: it is passed through too.
  ema_trainable, ema_frozen = state_lib.split_trainable(state.ema_params, config)
  ema_trainable = jax.tree.map(lambda e, p: e + (1.0 - decay) * (p - e), ema_trainable, trained)
  ema_params = state_lib.join_trainable(ema_trainable, ema_frozen)
  metrics = {
    "loss": loss,
    "nelbo_bits_per_token": loss / math.log(2.0),  # For "ar": the NLL in bits/token.
    "grad_norm": optax.tree.norm(objective.network_params(grads)),
    "learning_rate": state_lib.learning_rate_schedule(config)(state.step),
  }
  if objective.is_learned(config):  # The learned schedule's exponents w, of the raw params.
    w = objective.exponents(params, config)
    metrics.update(
      {
        "exponent_min": w.min(),
        "exponent_max": w.max(),
        "exponent_std": w.std(),
        "exponent_grad_norm": optax.tree.norm(grads[objective.SCHEDULE_PARAMS]),
      }
    )
  new_state = state.replace(
    step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema_params
  )
  return new_state, metrics


def make_train_step(
  config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh, state: TrainState
):
  """train_step jitted over `mesh` with the shardings of `state` (a state or its
  `state.abstract_state`), donating the state."""
  state_shardings = state_lib.state_shardings(state)

  def step(state, batch):
    with sharding.activation_rules(mesh):
      return train_step(state, batch, model=model, optimizer=optimizer, config=config)

  return jax.jit(
    step,
    in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
    out_shardings=(state_shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )


def _check_finite(step_metrics: list[tuple[int, dict]], last_checkpoint: Optional[int]):
  for step, metrics in step_metrics:
    if not math.isfinite(metrics["loss"]):
      kept = (
        f"the last good checkpoint (step {last_checkpoint}) is kept"
        if last_checkpoint
        else "no checkpoint was saved"
      )
      raise FloatingPointError(
        f"Loss is {metrics['loss']} at step {step}: stopping without saving this state; {kept}. "
        "Try a lower optimizer.learning_rate or optimizer.grad_clip_norm (> 0)."
      )


def train_loop(
  config: ml_collections.ConfigDict,
  state: TrainState,
  step_fn,
  iterator,
  mesh: Mesh,
  manager,
  writer,
  *,
  last_checkpoint: Optional[int],
  window: list[dict],
  stop: preemption.StopSignals,
  evaluate_fn: Callable[[TrainState], dict],
) -> tuple[TrainState, bool]:
  """Steps to config.num_train_steps, logging, checkpointing and calling evaluate_fn on schedule
  (not at the last step: the caller evaluates the final state). Returns (state, stopped):
  stopped when a signal ended the run early, after a checkpoint of the step it finished.

  writer: the run's outputs (md4jax.app.metrics_writer.MetricsWriter: write_train).
  `window` holds the metrics of the steps since the last log (restored with a checkpoint),
  so a resumed run logs exactly what the uninterrupted one would have.
  """
  start_step = int(sharding.to_host(state.step))
  progress_line = progress.ProgressLine(
    config.num_train_steps, config.eval_every_steps, config.checkpoint_every_steps
  )
  unchecked = []  # Device metrics not yet fetched.
  in_flight = []  # Metrics of the steps dispatched and not yet known finished.
  window_start, timed_steps = time.perf_counter(), 0
  tokens_per_step = config.batch_size * config.data.seq_len
  for step in range(start_step + 1, config.num_train_steps + 1):
    state, metrics = step_fn(state, sharding.device_batch(next(iterator), mesh))
    unchecked.append((step, metrics))
    bound_in_flight(in_flight, metrics)
    if step == start_step + 1:  # Compilation: keep it out of tokens/s.
      jax.block_until_ready(metrics)
      print(f"Compiled and ran the first step in {time.perf_counter() - window_start:.1f}s.")
      window_start = time.perf_counter()
    else:
      timed_steps += 1
    is_last = step == config.num_train_steps
    stopping = not is_last and stop.stop_after(step)
    should_log = step % config.log_every_steps == 0 or is_last
    should_save = step % config.checkpoint_every_steps == 0 or is_last or stopping
    should_eval = step % config.eval_every_steps == 0 and not is_last and not stopping
    if should_log or should_save or should_eval:
      # Every step's loss is checked before any save that includes it.
      fetched = sharding.to_host(unchecked)
      unchecked = []
      _check_finite(fetched, last_checkpoint)
      window += [{name: float(value) for name, value in m.items()} for _, m in fetched]
    if should_log:
      elapsed = time.perf_counter() - window_start
      record = {name: float(np.mean([m[name] for m in window])) for name in window[0]}
      record["learning_rate"] = window[-1]["learning_rate"]
      record["tokens_per_second"] = timed_steps * tokens_per_step / elapsed if timed_steps else 0.0
      writer.write_train(step, record)
      progress_line.update(
        step,
        record["loss"],
        record["tokens_per_second"],
        elapsed / timed_steps if timed_steps else 0.0,
      )
      window, window_start, timed_steps = [], time.perf_counter(), 0
    if should_save:
      save_start = time.perf_counter()
      checkpoint.save(manager, step, state, iterator.get_state(), config, {"window": window})
      last_checkpoint = step
      progress_line.record("checkpoint", time.perf_counter() - save_start)
      window_start += time.perf_counter() - save_start  # Keep the save out of tokens/s.
    if stopping:
      checkpoint.wait(manager)
      progress_line.finish()
      return state, True
    if should_eval:
      eval_start = time.perf_counter()
      evaluate_fn(state)
      progress_line.record("evaluation", time.perf_counter() - eval_start)
      window_start += time.perf_counter() - eval_start  # Keep evaluation out of tokens/s.
  progress_line.finish()
  return state, False
