"""Evaluation: NELBO or exact AR NLL, with a standard error; discrete-T bounds; a judge.

It takes the params to use (the trainer passes the EMA params) and scores
rows with `md4jax.training.objective`, the same per-sequence objective training uses.

Besides the headline bound (config.eval.estimator), an mdm evaluation measures,
on the same rows, the continuous bound with both the t-estimator and the
mask-count estimator (so their standard errors compare) and the discrete-time
bounds for config.eval.discrete_steps, and the per-t loss profile: the
integrand w(t)·Σ masked CE per token in config.eval.profile_bins bins of t,
whose mean over bins is itself a (stratified) estimate of the continuous
bound. A `Judge` (an AR model, `md4jax.app.judge` loads it from
config.eval.judge_workdir) scores the same rows exactly, and fresh samples
(generative perplexity) next to their unigram entropy, since a low perplexity
can just be low entropy.
"""

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax import rng
from md4jax.data import sources
from md4jax.diffusion import bounds, schedules, uniform
from md4jax.evaluation import estimates, likelihoods
from md4jax.runtime import sharding
from md4jax.training import objective


def profile_nats(
  params, batch: dict, key, *, model, config: ml_collections.ConfigDict
) -> jax.Array:
  """[B, bins]: w(t)·Σ masked CE (the uniform process: its integrand, t = (b + u²)/bins weighted
  by 2u) of each row with t uniform in each of config.eval.profile_bins bins.

  Bin b covers ((b)/bins, (b+1)/bins]; a row's mean over bins is a stratified
  draw of the schedule's part of the continuous bound (no endpoint terms).
  """
  bins = config.eval.profile_bins
  schedule = schedules.get_schedule(config.diffusion.schedule)  # Mask-rate schedules only.
  denoise_fn = objective.denoiser(model, params, batch, config=config)
  tokens, editable = batch["tokens"], batch["editable"].astype(bool)

  def one_bin(b):
    time_key, mask_key = jax.random.split(jax.random.fold_in(key, b))
    u = 1.0 - jax.random.uniform(time_key, tokens.shape[:1])  # In (0, 1].
    t = (b + u) / bins  # In (b/bins, (b+1)/bins].
    if config.diffusion.process == "uniform":  # Its own integrand (docs/math.md § 13).
      # t = (b + u²)/bins weighted by 2u: the same bin mean, of finite variance in the first
      # bin, where a uniform t's is not.
      t = (b + u * u) / bins
      return (
        2.0
        * u
        * uniform.continuous_loss_at(mask_key, denoise_fn, tokens, schedule, t, editable=editable)
      )
    return bounds.continuous_loss_at(
      mask_key,
      denoise_fn,
      tokens,
      schedule,
      t,
      mask_id=config.data.vocab_size,
      editable=editable,
      time_input=config.model.time_input,
    )

  return jax.lax.map(one_bin, jnp.arange(bins)).T


def discrete_steps(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """The T of config.eval.discrete_steps ("10,50,1000"; "" = none)."""
  return tuple(int(steps) for steps in config.eval.discrete_steps.split(",") if steps.strip())


def discrete_estimator(config: ml_collections.ConfigDict) -> str:
  """mask_count integrates t out, so it has no discrete-T form: the t-estimator stands in."""
  return "standard" if config.eval.estimator == "mask_count" else config.eval.estimator


def extra_bounds(config: ml_collections.ConfigDict) -> dict[str, tuple[str, Optional[int]]]:
  """name -> (estimator, num_steps) of the bounds measured beside the headline (mdm only)."""
  if config.model.type == "ar":
    return {}
  # A learned (state-dependent) schedule has one continuous bound, its own (md4jax.diffusion.genmd4).
  # The uniform process has one estimator, the standard one.
  one = objective.is_learned(config) or config.diffusion.process == "uniform"
  estimators = ("standard",) if one else ("standard", "mask_count")
  bounds = {f"continuous/{name}": (name, None) for name in estimators}
  bounds.update(
    {f"T{steps}": (discrete_estimator(config), steps) for steps in discrete_steps(config)}
  )
  return bounds


def make_eval_fn(
  config: ml_collections.ConfigDict,
  model,
  mesh,
  with_profile: bool = True,
  headline_only: bool = False,
):
  """Jitted (params, batch, key) -> {nats [b] (mean of the MC draws), nats/<bound> [b] (unless
  headline_only), profile_nats [b, bins] (mdm, eval.profile_bins > 0 and with_profile),
  order_nats [b] (eval.likelihood, unless headline_only), num_tokens [b], tokens, editable}."""
  num_draws = 1 if config.model.type == "ar" else config.eval.num_mc_samples
  extras = {} if headline_only else extra_bounds(config)
  with_profile = (
    with_profile
    and config.model.type == "mdm"
    and config.eval.profile_bins > 0
    and not objective.is_learned(config)
  )  # The profile is of w(t)·CE: one mask rate.

  def eval_fn(params, batch, key):
    def score(draw_key, estimator, num_steps=None):
      # Uniform (not stratified) t keeps the rows' estimates independent, so the
      # standard error over rows is honest.
      return objective.sequence_nats(
        params,
        batch,
        draw_key,
        model=model,
        config=config,
        estimator=estimator,
        t_sampling="uniform",
        num_steps=num_steps,
      )

    # name -> (estimator, num_steps, draws, index). The headline and the continuous bounds take
    # eval.num_mc_samples draws (the estimators compare at the same K), each discrete-time
    # bound eval.num_discrete_draws; draw j scores a bound with fold_in(key j, index), the
    # headline (index 0) with key j itself.
    scored = {"nats": (config.eval.estimator, None, num_draws, 0)}
    for i, (name, (estimator, num_steps)) in enumerate(extras.items()):
      if num_steps is not None or estimator != config.eval.estimator:  # Else: the headline.
        draws = num_draws if num_steps is None else config.eval.num_discrete_draws
        scored[f"nats/{name}"] = (estimator, num_steps, draws, i + 1)
    num_iterations = max(draws for _, _, draws, _ in scored.values())
    draw_key, profile_key = jax.random.split(key)
    rows = batch["tokens"].shape[0]

    # A continuous bound of the headline's estimator is the headline: its rows are the headline's.
    shared = [f"nats/{name}" for name in extras if f"nats/{name}" not in scored]

    def scores_of(bounds, key_j):
      return {
        name: score(jax.random.fold_in(key_j, index) if index else key_j, estimator, num_steps)
        for name, (estimator, num_steps, _, index) in bounds.items()
      }

    by_draws = {}  # draws -> the bounds that take them: one cond per group, not per bound.
    for name, bound in scored.items():
      by_draws.setdefault(bound[2], {})[name] = bound

    def add_draw(totals, xs):
      j, key_j = xs
      values = {}
      for draws, names in by_draws.items():
        draw = functools.partial(scores_of, names)
        if draws < num_iterations:  # Bounds with fewer draws: the last iterations skip them.
          nothing = {name: jnp.zeros(rows) for name in names}
          values.update(jax.lax.cond(j < draws, draw, lambda _, nothing=nothing: nothing, key_j))
        else:
          values.update(draw(key_j))
      values.update({name: values["nats"] for name in shared})
      return {name: totals[name] + values[name] for name in totals}, None

    # The shared rows ride in the carry too: without them libtpu 0.0.42's memory-space
    # assignment fails on text8's eval for v5e:2x2 (tests/test_aot.py), as it does with two
    # scans in a row. split(k, n)[:m] is split(k, m) (partitionable threefry), so the
    # headline's keys do not depend on the discrete bounds' draws.
    totals, _ = jax.lax.scan(
      add_draw,
      {name: jnp.zeros(rows) for name in [*scored, *shared]},
      (jnp.arange(num_iterations), jax.random.split(draw_key, num_iterations)),
    )
    outputs = {name: totals[name] / scored.get(name, scored["nats"])[2] for name in totals}
    outputs.update(
      num_tokens=batch["editable"].astype(jnp.int32).sum(-1),
      tokens=batch["tokens"],
      editable=batch["editable"],
    )
    if with_profile:
      outputs["profile_nats"] = profile_nats(params, batch, profile_key, model=model, config=config)
    if not headline_only and likelihoods.enabled(config):  # K·L calls a row: final ones only.
      outputs["order_nats"] = likelihoods.nats(params, batch, key, model=model, config=config)
    return outputs

  def sharded_eval_fn(params, batch, key):
    with sharding.activation_rules(mesh):
      return eval_fn(params, batch, key)

  # Params keep the layout they come with (the train state's); rows split over the batch axes.
  replicated = sharding.replicated(mesh)
  return jax.jit(
    sharded_eval_fn,
    in_shardings=(None, sharding.batch_sharding(mesh), replicated),
    out_shardings=replicated,
  )


def evaluate(
  config: ml_collections.ConfigDict,
  eval_fn,
  params,
  source: sources.Source,
  mesh,
  judge: Optional["Judge"] = None,
) -> dict:
  """NELBO bits/token of held-out rows ± standard error, against the truth where known.

  With a judge (an AR model), the same rows are also scored by it exactly: the
  side-by-side figures are paired, row by row, on the same tokens.
  """
  key = rng.stream(config.seed, "eval")
  if judge is not None:
    judge.check_compatible(config, config.data.seq_len, what="evaluation rows")
  outputs = []
  for i, batch in enumerate(source.eval_batches(config.eval.num_sequences, config.eval.batch_size)):
    outputs.append(
      sharding.to_host(
        eval_fn(params, sharding.device_batch(batch, mesh), np.asarray(jax.random.fold_in(key, i)))
      )
    )
    if judge is not None:
      outputs[-1]["judge_nats"] = judge.nats(batch)
  columns = {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
  # Padding rows fill the last batch.
  scored = np.flatnonzero(columns["num_tokens"] > 0)[: config.eval.num_sequences]
  columns = {k: v[scored] for k, v in columns.items()}
  nats, num_tokens, rows = columns["nats"], columns["num_tokens"], columns["tokens"]
  headline = estimates.bits_per_token(nats, num_tokens)
  mean, stderr = headline["bits_per_token"], headline["stderr"]
  results = {
    "nelbo_bits_per_token": mean,
    "nelbo_bits_per_token_stderr": stderr,
    "perplexity": 2.0**mean,
    "num_sequences": int(len(nats)),
    "num_tokens": int(num_tokens.sum()),
    "model_type": config.model.type,
  }
  if config.model.type == "ar":
    # The exact NLL; it is also stored as nelbo_* so readers of either model type work.
    results.update(
      nll_bits_per_token=mean,
      nll_bits_per_token_stderr=stderr,
      estimator="exact_nll",
      num_mc_samples=0,
    )
  else:
    results.update(estimator=config.eval.estimator, num_mc_samples=config.eval.num_mc_samples)
    results["estimators"] = {
      name: estimates.bits_per_token(columns[f"nats/continuous/{name}"], num_tokens)
      for name in ("standard", "mask_count")
      if f"nats/continuous/{name}" in columns
    }
    if discrete_steps(config) and f"nats/T{discrete_steps(config)[0]}" in columns:
      results["discrete_time"] = {
        str(steps): estimates.bits_per_token(columns[f"nats/T{steps}"], num_tokens)
        for steps in discrete_steps(config)
      }
      results["discrete_time_estimator"] = discrete_estimator(config)
      results["discrete_time_num_mc_samples"] = config.eval.num_discrete_draws
    if "profile_nats" in columns:
      results["loss_profile"] = estimates.loss_profile(
        columns["profile_nats"], num_tokens, config.diffusion.schedule
      )
    results.update(likelihoods.results(config, columns, source))  # eval.likelihood's, if any.
  if objective.is_learned(config):
    results["learned_schedule"] = learned_exponents(params, config, source)
  if judge is not None:
    results["side_by_side"] = estimates.side_by_side(
      nats, columns["judge_nats"], num_tokens, judge.workdir
    )
  lengths = source.text_lengths(rows, columns["editable"].astype(bool))
  if lengths is not None:
    # Per character of the decoded text and per UTF-8 byte the scored ids stand for, so
    # models with different tokenizers compare.
    characters, num_bytes = lengths
    if characters:
      results["bits_per_character"] = float(nats.sum() / (math.log(2.0) * characters))
      results["num_characters"] = int(characters)
    if num_bytes is not None:
      results["bits_per_byte"] = float(nats.sum() / (math.log(2.0) * num_bytes))
      results["num_bytes"] = num_bytes
  if source.true_bits_per_token is not None:
    true_bits = source.true_bits_per_token
    bits = nats / (num_tokens * math.log(2.0))
    # The excess over the exact −log2 p of the same sequences cancels their sampling noise.
    excess, excess_stderr = estimates.mean_and_stderr(bits - source.true_bits_per_token_of(rows))
    results.update(
      true_bits_per_token=true_bits,
      gap_percent=100.0 * (mean - true_bits) / true_bits,
      excess_bits_per_token=excess,
      excess_bits_per_token_stderr=excess_stderr,
    )
  return results


def learned_exponents(params, config: ml_collections.ConfigDict, source) -> dict:
  """The learned schedule's w_v per token (α_v = 1 − t^{w_v}), sorted from the largest w (masked
  last, revealed first) to the smallest, with each token's text."""
  w = np.asarray(jax.device_get(objective.exponents(params, config)), np.float64)
  order = np.argsort(-w)
  return {
    "schedule": config.diffusion.schedule,
    "token_ids": [int(i) for i in order],
    "tokens": [source.token_text(int(i)) for i in order],
    "exponents": [float(w[i]) for i in order],
    "min": float(w.min()),
    "max": float(w.max()),
    "std": float(w.std()),
  }


# ---- Sample quality under a judge ----
class Judge:
  """An AR model of ours that scores token sequences exactly: generative perplexity.

  Rows are split over the mesh's data axis like the evaluation batches.
  """

  def __init__(self, config: ml_collections.ConfigDict, model, params, mesh, workdir: str = ""):
    self.config, self.model, self.params = config, model, params
    self.mesh, self.workdir = mesh, workdir

    def score(params, batch):
      with sharding.activation_rules(mesh):
        return objective.sequence_nats(
          params, batch, None, model=model, config=config, estimator="exact", t_sampling="uniform"
        )

    self._score = jax.jit(
      score,
      in_shardings=(None, sharding.batch_sharding(mesh)),
      out_shardings=sharding.replicated(mesh),
    )

  def check_compatible(self, config: ml_collections.ConfigDict, length: int, what: str = "samples"):
    """Raises ValueError unless the judge models config's data and can score `length` tokens."""
    if self.config.data.vocab_size != config.data.vocab_size:
      raise ValueError(
        f"The judge's vocab_size {self.config.data.vocab_size} differs from the "
        f"evaluated model's {config.data.vocab_size}: it cannot score these tokens."
      )
    # A char alphabet or a BPE is built from the corpus: same size does not mean same ids.
    same_data = (
      ["dataset", "language_seed", "concentration"]
      if config.data.dataset == "markov"
      else ["dataset", "path", "tokenizer", "bpe_vocab_size", "tokenizer_path"]
    )
    for name in same_data:
      if self.config.data[name] != config.data[name]:
        raise ValueError(
          f"The judge {self.workdir} was trained with data.{name}="
          f"{self.config.data[name]!r}, the evaluated model with {config.data[name]!r}: "
          "its scores would not be about the same data and token ids."
        )
    if length > self.config.data.seq_len:
      raise ValueError(
        f"The {what} are {length} tokens long, past the judge's context "
        f"(data.seq_len={self.config.data.seq_len} in {self.workdir})."
      )

  def nats(self, batch: dict) -> np.ndarray:
    """Exact NLL in nats of each row's editable tokens [B] under the judge (host batch dict)."""
    rows = batch["tokens"].shape[0]
    # Rows that are not editable fill the last device's share.
    missing = -rows % self.mesh.devices.size
    padded = sources.pad_rows(batch, missing)
    nats = self._score(self.params, sharding.device_batch(padded, self.mesh))
    return np.asarray(sharding.to_host(nats), np.float64)[:rows]

  def score(self, tokens: np.ndarray, prompt_length: int = 0) -> dict:
    """Generative perplexity of tokens [n, L] under the judge and their sample entropy, ± SE.

    The first prompt_length tokens (a given prompt) are context only: neither scored nor counted.
    """
    tokens = np.asarray(tokens, np.int32)
    batch = sources.dense_batch(tokens)
    batch["editable"][:, :prompt_length] = False
    perplexity, perplexity_stderr = estimates.generative_perplexity(
      self.nats(batch), batch["editable"].sum(-1)
    )
    entropy, entropy_stderr = estimates.sample_entropy(tokens[:, prompt_length:])
    return {
      "generative_perplexity": perplexity,
      "generative_perplexity_stderr": perplexity_stderr,
      "sample_entropy": entropy,
      "sample_entropy_stderr": entropy_stderr,
    }


def summary(results: dict) -> str:
  """Human-readable lines for the end of a run."""
  name = "NLL" if results["model_type"] == "ar" else "NELBO"
  lines = [
    f"{name} {results['nelbo_bits_per_token']:.4f} ± {results['nelbo_bits_per_token_stderr']:.4f} "
    f"bits/token ({results['num_sequences']} held-out sequences, {results['estimator']})"
  ]
  lines += likelihoods.summary(results)
  if "true_bits_per_token" in results:
    lines.append(
      f"exact entropy {results['true_bits_per_token']:.4f} bits/token; "
      f"gap {results['gap_percent']:+.2f}% "
      f"(paired excess {results['excess_bits_per_token']:.4f} ± "
      f"{results['excess_bits_per_token_stderr']:.4f} bits/token)"
    )
  return "\n".join(lines)
