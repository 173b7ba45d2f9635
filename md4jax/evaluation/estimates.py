"""Figures with their standard errors from per-row scores (md4jax.evaluation.evaluate's rows,
or samples): bits per token, the per-t loss profile, the side-by-side with an AR judge, and the
quality of samples under one.

Rows are independent, so a standard error is over rows; a ratio of sums (per token, model over
judge) takes the delta method (docs/math.md, section 6).
"""

import math

import numpy as np

from md4jax.diffusion import schedules


def mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
  """The mean of independent values and its standard error (NaN for a single value)."""
  stderr = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
  return float(values.mean()), float(stderr)


def per_token_and_stderr(nats: np.ndarray, num_tokens: np.ndarray) -> tuple[float, float]:
  """Σ nats / Σ tokens (per valid token, never per mask) and its delta-method standard error."""
  ratio = nats.sum() / num_tokens.sum()
  residual = nats - ratio * num_tokens
  n = len(nats)
  stderr = (
    math.sqrt((residual**2).sum() / (n * (n - 1))) / num_tokens.mean() if n > 1 else float("nan")
  )
  return float(ratio), float(stderr)


def bits_per_token(nats: np.ndarray, num_tokens: np.ndarray) -> dict:
  """{bits_per_token, stderr}: per_token_and_stderr in bits."""
  per_token, stderr = per_token_and_stderr(nats, num_tokens)
  return {"bits_per_token": per_token / math.log(2.0), "stderr": stderr / math.log(2.0)}


def loss_profile(nats: np.ndarray, num_tokens: np.ndarray, schedule: str) -> dict:
  """eval.json's loss_profile from profile_nats [rows, bins]: bits/token ± SE per bin and their mean.

  The mean is the continuous bound only when the schedule needs no endpoint terms
  (endpoint_terms_excluded False): α(0) = 1 and α(1) = 0.
  """
  bins = nats.shape[1]
  per_bin = [bits_per_token(nats[:, b], num_tokens) for b in range(bins)]
  mean = bits_per_token(nats.mean(axis=1), num_tokens)  # Per row first: the bins share rows.
  alpha = schedules.get_schedule(schedule)
  return {
    "schedule": schedule,
    "t_edges": [b / bins for b in range(bins + 1)],
    "endpoint_terms_excluded": bool(alpha.needs_reconstruction_term or alpha.needs_prior_term),
    "bits_per_token": [f["bits_per_token"] for f in per_bin],
    "stderr": [f["stderr"] for f in per_bin],
    "mean_bits_per_token": mean["bits_per_token"],
    "mean_stderr": mean["stderr"],
  }


def side_by_side(
  nats: np.ndarray, judge_nats: np.ndarray, num_tokens: np.ndarray, judge_workdir: str
) -> dict:
  """The evaluated model against the AR judge on the same rows: both figures, their paired
  difference and ratio, each ± a standard error over rows."""
  judge_bits, difference = (
    bits_per_token(judge_nats, num_tokens),
    bits_per_token(nats - judge_nats, num_tokens),
  )
  ratio, ratio_stderr = per_token_and_stderr(nats, judge_nats)  # Σ model / Σ judge.
  return {
    "judge_workdir": judge_workdir,
    "judge_nll_bits_per_token": judge_bits["bits_per_token"],
    "judge_nll_bits_per_token_stderr": judge_bits["stderr"],
    "difference_bits_per_token": difference["bits_per_token"],
    "difference_bits_per_token_stderr": difference["stderr"],
    "ratio": ratio,
    "ratio_stderr": ratio_stderr,
  }


def generative_perplexity(nats: np.ndarray, num_tokens: np.ndarray) -> tuple[float, float]:
  """exp(Σ judge NLL / Σ tokens) of samples, and its delta-method standard error."""
  per_token, stderr = per_token_and_stderr(np.asarray(nats, np.float64), np.asarray(num_tokens))
  return math.exp(per_token), math.exp(per_token) * stderr


def sample_entropy(tokens: np.ndarray) -> tuple[float, float]:
  """Mean over samples of the unigram entropy of each sample's tokens, in bits, ± standard error."""
  entropies = []
  for row in np.asarray(tokens):
    counts = np.unique(row, return_counts=True)[1]
    p = counts / counts.sum()
    entropies.append(float(-(p * np.log2(p)).sum()))
  return mean_and_stderr(np.asarray(entropies))
