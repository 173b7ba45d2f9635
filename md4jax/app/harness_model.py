"""An md4jax workdir as the lm-evaluation-harness model (`md4jax.app.harness`) runs it:
loaded (`md4jax.load`: config, network, EMA params, tokenizer), its rows scored and sampled.

A row is one window of the model's context, data.seq_len tokens: [context][scored or generated
tokens][padding]. The real tokens are segment 1 and the padding segment 0, which they never
attend to (the network's segment mask), so rows of any length share one compiled program.
Only the scored tokens are `editable` (the conditional path of `md4jax.training.objective`):
the context is read at every call and never masked.

Every draw of a row depends on the seed and its `row_id` (a checksum of its tokens), never on
the batch it rides in or on the other requests, so a request scores the same in any task mix.
"""

import math
import zlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax import rng
from md4jax.app import load
from md4jax.diffusion import orders
from md4jax.evaluation import likelihoods
from md4jax.runtime import sharding
from md4jax.training import checkpoint, objective

# rng.stream(seed, this): every draw of the harness, apart from training's and evaluation's.
KEY_STREAM = "lm_eval"


class HarnessError(ValueError):
  """What the user must fix (a workdir, a model_arg, a request): shown in one line."""


Loaded = load.Loaded  # What the harness runs: a loaded workdir, or a test's exact oracle.


def override(config: ml_collections.ConfigDict, name: str, value):
  """Sets the dotted key `name` (e.g. "sample.num_steps") of config; HarnessError if unknown."""
  try:
    load.override(config, name, value)
  except ValueError as e:
    raise HarnessError(str(e)) from None


def load_workdir(path, overrides: dict) -> Loaded:
  """`md4jax.load` of the workdir `path` with `overrides` (dotted key -> value), validated as
  md4jax.main validates; HarnessError in one line for anything it cannot load."""
  try:
    return load.load(path, overrides=overrides, role="workdir")
  except (ValueError, FileNotFoundError, checkpoint.CheckpointError) as e:
    raise HarnessError(" ".join(str(e).split())) from None


def row_id(tokens: np.ndarray, editable: np.ndarray, repeat: int = 0) -> int:
  """A row's draws' index: a checksum of its tokens, of which of them are scored or sampled,
  and of `repeat` (the equal rows before it that must draw afresh: lm-eval's repeats)."""
  data = np.concatenate([np.asarray(tokens, np.int32), np.asarray(editable, np.int32), [repeat]])
  return zlib.crc32(data.tobytes()) & 0x7FFFFFFF  # fold_in takes 32 bits; int32 stays positive.


def batch_of(tokens: np.ndarray, editable: np.ndarray, lengths: np.ndarray) -> dict:
  """objective's batch of rows [B, L] whose first lengths[b] tokens are real, the rest padding."""
  length = tokens.shape[1]
  real = np.arange(length)[None] < np.asarray(lengths)[:, None]
  return {
    "tokens": np.asarray(tokens, np.int32),
    "segment_ids": real.astype(np.int32),
    "positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape).copy(),
    "editable": np.asarray(editable, bool) & real,
  }


def estimate(kind: str, per_draw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(nats [B], standard error [B]) of each row from its draws [K, B] of `kind`.

  nelbo: the mean of K independent NELBO draws ± their SE (NaN for K = 1). order and an ar
  model: exact (SE 0). orders: −log of the mean of the K orders' likelihoods, ± its
  delta-method SE std(w)/(√K mean(w)) around its expectation (itself a bound above the NLL).
  """
  per_draw = np.asarray(per_draw, np.float64)
  draws = per_draw.shape[0]
  if kind in ("exact", "order"):
    return per_draw[0], np.zeros(per_draw.shape[1])
  if kind == "nelbo":
    stderr = per_draw.std(0, ddof=1) / math.sqrt(draws) if draws > 1 else per_draw[0] * np.nan
    return per_draw.mean(0), stderr
  log_w = -per_draw  # log p_{π_k}(x) [K, B].
  log_mean = np.logaddexp.reduce(log_w, axis=0) - math.log(draws)
  if draws == 1:
    return -log_mean, log_mean * np.nan
  relative_variance = np.exp(np.logaddexp.reduce(2 * (log_w - log_mean), axis=0) - math.log(draws))
  spread = np.maximum(relative_variance - 1.0, 0.0) * draws / (draws - 1)  # var(w) / mean(w)².
  return -log_mean, np.sqrt(spread / draws)


class Scorer:
  """Jitted scoring of rows: per-draw nats of the continuation and whether it is greedy.

  kind (`estimate`): "exact" for an ar model, else config.eval.likelihood's ("nelbo", "order"
  or "orders"); nelbo takes config.eval.num_mc_samples draws of config.eval.estimator.
  """

  def __init__(self, loaded: Loaded, seed: int):
    self.loaded, config = loaded, loaded.config
    if config.diffusion.process != "masked":
      raise ValueError(
        "lm_eval scores and decodes with the masked process's estimators and mask id; "
        f"diffusion.process={config.diffusion.process!r} is not supported yet."
      )
    likelihood, num_orders = likelihoods.parse_likelihood(config.eval.likelihood)
    is_ar = config.model.type == "ar"
    self.kind = "exact" if is_ar else "nelbo" if likelihood == "nelbo" else likelihood
    draws = {"exact": 1, "nelbo": config.eval.num_mc_samples, "order": 1, "orders": num_orders}
    self.draws = draws[self.kind]
    self.key = np.asarray(rng.stream(seed, KEY_STREAM))
    model, mesh, mask_id = loaded.model, loaded.mesh, config.data.vocab_size

    def per_draw(params, batch, row_ids, key):
      if self.kind in ("exact", "nelbo"):

        def draw(k):
          return objective.sequence_nats(
            params,
            batch,
            jax.random.fold_in(key, k),
            model=model,
            config=config,
            estimator=config.eval.estimator,
            t_sampling="uniform",  # Each row's t from its own key: rows stay independent.
            row_index=row_ids,
          )

        return jax.lax.map(draw, jnp.arange(self.draws))
      denoise_fn = likelihoods.order_denoiser(params, batch, model=model, config=config)
      tokens, editable = batch["tokens"], batch["editable"]
      if self.kind == "order":  # Left to right over the continuation.
        order = jnp.arange(tokens.shape[1])
        return orders.order_nll(denoise_fn, tokens, order, mask_id=mask_id, editable=editable)[None]
      return orders.random_orders_nlls(
        key, denoise_fn, tokens, self.draws, mask_id=mask_id, editable=editable, row_index=row_ids
      )

    def greedy(params, batch):
      tokens, editable = batch["tokens"], batch["editable"]
      segments, positions = batch["segment_ids"], batch["positions"]
      if is_ar:  # The next-token argmax at every scored position.
        inputs = objective.ar_inputs(tokens, mask_id, positions)
        logits = model.apply({"params": params}, inputs, None, segments, positions)
      else:  # One call with the whole continuation masked: time t = 1.
        schedule = objective.schedule_of(params, config)
        denoise_fn = objective.sampling_denoiser(model, params, config, segments, positions)
        everything_masked = 1.0 if schedule.state_dependent else 0.0  # t, else α.
        z = jnp.where(editable, mask_id, tokens)
        logits = denoise_fn(z, jnp.full(tokens.shape[:1], everything_masked))
      hits = (jnp.argmax(logits, axis=-1) == tokens) | ~editable
      return hits.all(axis=-1)

    def score(params, batch, row_ids, key):
      with sharding.activation_rules(mesh):
        return per_draw(params, batch, row_ids, key), greedy(params, batch)

    rows = sharding.batch_sharding(mesh)
    self._score = jax.jit(
      score,
      in_shardings=(None, rows, rows, sharding.replicated(mesh)),
      out_shardings=sharding.replicated(mesh),
    )

  def score(self, batch: dict, row_ids: np.ndarray) -> dict:
    """{nats, stderr, greedy} [B] of a host batch (`batch_of`) whose rows are `row_ids`."""
    mesh = self.loaded.mesh
    per_draw, greedy = self._score(
      self.loaded.params,
      sharding.device_batch(batch, mesh),
      sharding.device_batch(np.asarray(row_ids, np.int32), mesh),
      self.key,
    )
    nats, stderr = estimate(self.kind, sharding.to_host(per_draw))
    return {"nats": nats, "stderr": stderr, "greedy": np.asarray(sharding.to_host(greedy))}
