"""The sample-quality frontier: generative perplexity against sample entropy, swept over samplers.

A low generative perplexity alone can be low entropy (repetition). Each point
of the sweep draws config.frontier.num_samples fresh samples at one (method,
num_steps, temperature) and records both, ± standard errors over samples:
  * under the AR judge of config.eval.judge_workdir (generative perplexity);
  * under the true law when the data has one (markov): the exact perplexity.
Held-out data rows are scored the same way, as the reference point the
samples should reach. Writes WORKDIR/frontier.json and WORKDIR/plots/frontier.png:

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default \
      --mode=frontier --config.eval.judge_workdir=/tmp/md4jax_default_ar
"""

import itertools
import json
import math
import pathlib
from typing import Optional

import jax
import ml_collections
import numpy as np

from md4jax import config as config_lib
from md4jax import rng
from md4jax.app import generate, plots
from md4jax.evaluation import estimates, evaluate
from md4jax.runtime import workdir as workdir_lib


def sweep_settings(config: ml_collections.ConfigDict) -> list[dict]:
  """The (method, num_steps or threshold, temperature) of every point; ar: one per temperature.

  first_hitting takes no steps (one point per temperature); threshold sweeps
  frontier.thresholds in place of the steps.
  """
  temperatures = config_lib.parse_list(config.frontier.temperatures, float)
  if config.model.type == "ar":
    return [
      {"method": "ar", "num_steps": None, "threshold": None, "temperature": t} for t in temperatures
    ]
  methods = config_lib.parse_list(config.frontier.methods, str.strip)
  steps = config_lib.parse_list(config.frontier.num_steps, int)
  thresholds = config_lib.parse_list(config.frontier.thresholds, float)
  settings = []
  for method, t in itertools.product(methods, temperatures):
    if method == "first_hitting":
      settings.append({"method": method, "num_steps": None, "threshold": None, "temperature": t})
    elif method == "threshold":
      settings += [
        {"method": method, "num_steps": None, "threshold": h, "temperature": t} for h in thresholds
      ]
    else:
      settings += [
        {"method": method, "num_steps": s, "threshold": None, "temperature": t} for s in steps
      ]
  return settings


def _point_config(config: ml_collections.ConfigDict, setting: dict) -> ml_collections.ConfigDict:
  point = config.copy_and_resolve_references()
  point.sample.num_samples = config.frontier.num_samples
  point.sample.temperature = setting["temperature"]
  if setting["method"] != "ar":
    point.sample.method = setting["method"]
    point.sample.num_steps = setting["num_steps"] or config.sample.num_steps
    point.sample.threshold = setting["threshold"] or config.sample.threshold
  return point


def _true_figures(source, tokens: np.ndarray) -> dict:
  """Exact −log2 p per token of the rows under the data's law, and its perplexity, ± SE."""
  mean, stderr = estimates.mean_and_stderr(source.true_bits_per_token_of(tokens))
  return {
    "true_bits_per_token": mean,
    "true_bits_per_token_stderr": stderr,
    "true_perplexity": 2.0**mean,
    "true_perplexity_stderr": 2.0**mean * math.log(2.0) * stderr,
  }


def _scores(tokens: np.ndarray, judge: Optional[evaluate.Judge], source, knows_truth: bool) -> dict:
  if judge is not None:
    scores = judge.score(tokens)
  else:
    entropy, entropy_stderr = estimates.sample_entropy(tokens)
    scores = {"sample_entropy": entropy, "sample_entropy_stderr": entropy_stderr}
  if knows_truth:
    scores.update(_true_figures(source, tokens))
  return scores


def _reference_rows(config: ml_collections.ConfigDict, source, length: int) -> Optional[np.ndarray]:
  """Up to frontier.num_samples held-out rows with no padding, cut to the sample length."""
  if length > config.data.seq_len:
    return None
  rows = []
  for batch in source.eval_batches(config.frontier.num_samples, config.eval.batch_size):
    full = np.asarray(batch["editable"]).astype(bool).all(-1)
    rows += list(np.asarray(batch["tokens"])[full][:, :length])
  return np.stack(rows[: config.frontier.num_samples]) if len(rows) >= 2 else None


def run(
  config: ml_collections.ConfigDict, model, params, source, judge: Optional[evaluate.Judge] = None
) -> dict:
  """Samples and scores every point of the sweep; returns frontier.json's contents."""
  knows_truth = source.true_bits_per_token is not None
  if config.sample.prompt:
    raise ValueError(
      "--mode=frontier compares unprompted samples with held-out rows; unset "
      f"sample.prompt (got {config.sample.prompt!r})."
    )
  if judge is None and not knows_truth:
    raise ValueError(
      "--mode=frontier needs a judge: set --config.eval.judge_workdir to an md4jax AR "
      f"workdir (data.dataset={config.data.dataset!r} has no known law to score by)."
    )
  run_settings = generate.settings(config)
  length = run_settings["length"]
  if judge is not None:
    judge.check_compatible(config, length)
  key = rng.stream(config.seed, "frontier")
  points = []
  for i, setting in enumerate(sweep_settings(config)):
    point_config = _point_config(config, setting)
    tokens, nfe, seconds, _ = generate.generate(
      point_config, model, params, source, jax.random.fold_in(key, i)
    )
    points.append(
      {**setting, "nfe": nfe, "seconds": seconds, **_scores(tokens, judge, source, knows_truth)}
    )
    print(json.dumps(points[-1]))
  results = {
    "model_type": config.model.type,
    "num_samples": config.frontier.num_samples,
    "length": length,
    "judge_workdir": judge.workdir if judge else None,
    "points": points,
    "sampler": {
      k: v
      for k, v in run_settings.items()
      if k not in ("method", "num_steps", "threshold", "temperature")
    },
  }
  reference = _reference_rows(config, source, length)
  if reference is not None:
    results["data"] = {
      "num_rows": int(len(reference)),
      **_scores(reference, judge, source, knows_truth),
    }
  if knows_truth:
    results["true_bits_per_token"] = source.true_bits_per_token
  return results


def write(workdir, results: dict) -> list[pathlib.Path]:
  """WORKDIR/frontier.json and WORKDIR/plots/frontier.png."""
  workdir = workdir_lib.as_workdir(workdir)
  json_path = workdir.frontier_json
  json_path.write_text(json.dumps(results, indent=2) + "\n")
  png_path = workdir.plot("frontier.png")
  plots.draw_frontier(results, png_path)
  return [json_path, png_path]
