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


# ---- Diversity of samples against a known first-order chain ----
def bigram_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
  """[V, V] counts of adjacent pairs (a, b) over every row of tokens [n, L]."""
  tokens = np.asarray(tokens, np.int64)
  pairs = tokens[:, :-1] * vocab_size + tokens[:, 1:]
  return np.bincount(pairs.ravel(), minlength=vocab_size * vocab_size).reshape(
    vocab_size, vocab_size
  )


def chain_entropy(counts: np.ndarray) -> float:
  """Bits per token of the first-order chain fitted to bigram counts: −Σ_ab (n_ab / N)
  log2(n_ab / n_a), the plug-in conditional entropy (mode-seeking samples lower it)."""
  counts = np.asarray(counts, np.float64)
  rows = counts.sum(1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(counts > 0, counts * np.log2(counts / rows), 0.0)
  return float(-terms.sum() / counts.sum())


def bigram_tv(counts: np.ndarray, truth: np.ndarray) -> float:
  """Total-variation distance between the bigram frequencies of counts and the table truth
  [V, V] (Σ = 1): ½ Σ_ab |n_ab / N − truth_ab|."""
  counts = np.asarray(counts, np.float64)
  return float(0.5 * np.abs(counts / counts.sum() - truth).sum())


def diversity(tokens: np.ndarray, truth: np.ndarray, references: list) -> dict:
  """Samples' fitted-chain entropy and bigram TV distance to the truth [V, V], each against the
  same statistic of exact samples of the same size (`references`: several such batches): the
  difference and its SE, the spread of the reference batches (the statistic's sampling error
  under an exact sampler, of the sample and of the reference mean). Both statistics are biased
  at a finite sample size (the plug-in entropy low, the TV high); an exact sampler's batches
  share that bias, so its differences are 0 within SE."""
  vocab_size = truth.shape[0]
  counts = bigram_counts(tokens, vocab_size)
  reference_counts = [bigram_counts(r, vocab_size) for r in references]
  figures = {}
  for name, statistic in (
    ("chain_entropy", chain_entropy),
    ("bigram_tv", lambda c: bigram_tv(c, truth)),
  ):
    values = np.asarray([statistic(c) for c in reference_counts])
    spread = values.std(ddof=1) * math.sqrt(1.0 + 1.0 / len(values))
    figures[name] = statistic(counts)
    figures[f"{name}_excess"] = figures[name] - float(values.mean())
    figures[f"{name}_stderr"] = float(spread)
  return figures
