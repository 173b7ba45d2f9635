"""eval.md: the results of an evaluation as a Markdown report a person reads.

Every figure carries its ± standard error; diffusion figures are upper bounds
on the NLL and are written "≤", the AR figure is the exact NLL; the estimator
and the number of Monte Carlo draws are stated, and so are the true entropy
and the gap when the data's law is known.
"""

import pathlib

from md4jax.runtime import workdir as workdir_lib

ESTIMATOR_NAMES = {
  "standard": "t-estimator (t ~ U(0,1), w(t)·Σ masked CE)",
  "mask_count": "mask-count estimator (k masked ~ U, t integrated out)",
  "forced_target": "forced-target estimator (one forced masked position)",
  "exact_nll": "exact NLL (causal factorization)",
}


def _pm(value, stderr, digits: int = 4) -> str:
  if stderr is None:
    return f"{value:.{digits}f}"
  return f"{value:.{digits}f} ± {stderr:.{digits}f}"


def render(results: dict) -> str:
  """The Markdown text of eval.json's `results`: the headline, then each section it holds."""
  lines = _headline(results) + _estimator_note(results)
  for section in (
    _side_by_side,
    _estimators,
    _orders,
    _discrete_time,
    _loss_profile,
    _learned_schedule,
    _judged_samples,
  ):
    lines += section(results)
  return "\n".join(lines) + "\n"


def _nelbo(results: dict) -> str:
  """The headline bits/token ± its standard error."""
  return _pm(results["nelbo_bits_per_token"], results["nelbo_bits_per_token_stderr"])


def _headline(results: dict) -> list[str]:
  """The title, the rows scored and the table of the headline figures."""
  is_ar = results["model_type"] == "ar"
  step = results.get("step")
  lines = [f"# Evaluation{f' at step {step}' if step is not None else ''}", ""]
  lines.append(
    f"{results['num_sequences']} held-out sequences, {results['num_tokens']} scored tokens; "
    "± is one standard error over sequences."
  )
  lines.append("")
  lines += ["| Quantity | Value |", "|---|---|"]
  if is_ar:
    lines.append(f"| exact NLL (bits/token) | {_nelbo(results)} |")
    lines.append(f"| perplexity | {results['perplexity']:.4f} |")
  else:
    lines.append(f"| NELBO (bits/token) | ≤ {_nelbo(results)} |")
    lines.append(f"| perplexity | ≤ {results['perplexity']:.4f} |")
  relation = "=" if is_ar else "≤"  # An AR figure is the exact NLL, a diffusion one a bound.
  if "bits_per_character" in results:
    lines.append(
      f"| bits/character ({results['num_characters']} characters) | "
      f"{relation} {results['bits_per_character']:.4f} |"
    )
  if "bits_per_byte" in results:
    lines.append(
      f"| bits/byte ({results['num_bytes']} UTF-8 bytes) | "
      f"{relation} {results['bits_per_byte']:.4f} |"
    )
  if "true_bits_per_token" in results:
    lines.append(f"| true entropy (bits/token) | {results['true_bits_per_token']:.4f} |")
    lines.append(f"| gap to the entropy | {results['gap_percent']:+.2f}% |")
    lines.append(
      f"| paired excess over −log2 p (bits/token) | "
      f"{_pm(results['excess_bits_per_token'], results['excess_bits_per_token_stderr'])} |"
    )
  return lines + [""]


def _estimator_note(results: dict) -> list[str]:
  """The estimator behind the headline, and whether it is a bound or a measurement."""
  if results["model_type"] == "ar":
    return [
      "Estimator: exact NLL — the causal model's likelihood, no Monte Carlo (a measurement, "
      "not a bound)."
    ]
  estimator = results["estimator"]
  return [
    f"Estimator: {ESTIMATOR_NAMES.get(estimator, estimator)}, "
    f"K = {results['num_mc_samples']} Monte Carlo draws per sequence. "
    "The NELBO is an upper bound on the NLL (≤)."
  ]


def _side_by_side(results: dict) -> list[str]:
  """The evaluated model and the AR judge on the same rows, paired."""
  if "side_by_side" not in results:
    return []
  is_ar = results["model_type"] == "ar"
  pair = results["side_by_side"]
  name = "exact NLL" if is_ar else "NELBO"
  return [
    "",
    "## Side by side with the AR judge",
    "",
    f"The same {results['num_sequences']} sequences and tokens scored by the AR model of "
    f"`{pair['judge_workdir']}` (exact NLL); the difference and ratio are paired by sequence.",
    "",
    "| Quantity | Value |",
    "|---|---|",
    f"| this model's {name} (bits/token) | {'' if is_ar else '≤ '}{_nelbo(results)} |",
    f"| AR judge's exact NLL (bits/token) | "
    f"{_pm(pair['judge_nll_bits_per_token'], pair['judge_nll_bits_per_token_stderr'])} |",
    f"| difference (bits/token) | "
    f"{_pm(pair['difference_bits_per_token'], pair['difference_bits_per_token_stderr'])} |",
    f"| ratio {name} / AR NLL | {_pm(pair['ratio'], pair['ratio_stderr'])} |",
  ]


def _estimators(results: dict) -> list[str]:
  """The continuous bound by each estimator, on the same rows and draws."""
  if "estimators" not in results:
    return []
  lines = [
    "",
    "## Continuous-time bound by estimator",
    "",
    "Same sequences, same K; the expectation "
    "is the same, only the variance differs. The t-estimator weights the few tokens masked "
    "at small t by w(t), which is unbounded there (1/t for the linear schedule), so its "
    "spread, and its standard error, are heavy-tailed; the mask-count estimator's are not.",
    "",
    "| Estimator | NELBO (bits/token) |",
    "|---|---|",
  ]
  for name, figure in results["estimators"].items():
    lines.append(
      f"| {ESTIMATOR_NAMES.get(name, name)} | ≤ {_pm(figure['bits_per_token'], figure['stderr'])} |"
    )
  return lines


def _orders(results: dict) -> list[str]:
  """eval.likelihood: the exact likelihood over orders, beside the NELBO on the same rows."""
  if "order_bits_per_token" not in results:
    return []
  if results["likelihood"] == "order":
    what, relation = "the left-to-right order: the exact NLL of that autoregressive model", "="
  else:
    what, relation = (
      f"{results['num_orders']} random orders per sequence, importance-weighted: an upper "
      "bound on the model's NLL in expectation, at most the NELBO's and tighter as K grows",
      "≤",
    )
  lines = [
    "",
    "## Likelihood over orders",
    "",
    f"`eval.likelihood = {results['likelihood']}`: −log p of each sequence revealed one token at "
    f"a time along {what} (docs/math.md § 5b). The difference is paired by sequence.",
    "",
    "| Quantity | Value |",
    "|---|---|",
    f"| {results['likelihood']} (bits/token) | {relation} "
    f"{_pm(results['order_bits_per_token'], results['order_bits_per_token_stderr'])} |",
  ]
  for name, label in (
    ("order_minus_nelbo", "minus the NELBO"),
    ("order_excess", "paired excess over −log2 p"),
  ):
    if f"{name}_bits_per_token" in results:
      figure = _pm(results[f"{name}_bits_per_token"], results[f"{name}_bits_per_token_stderr"])
      lines.append(f"| {label} (bits/token) | {figure} |")
  return lines


def _discrete_time(results: dict) -> list[str]:
  """The discrete-time bounds by T, and the continuous one as T = ∞."""
  if "discrete_time" not in results:
    return []
  lines = [
    "",
    "## Discrete-time bounds",
    "",
    f"Estimator: {ESTIMATOR_NAMES.get(results['discrete_time_estimator'])}, "
    f"K = {results['discrete_time_num_mc_samples']} Monte Carlo draws per sequence. "
    "A bound with T "
    "steps is looser than the continuous one and tightens as T grows.",
    "",
    "| T | NELBO (bits/token) |",
    "|---|---|",
  ]
  for steps, figure in results["discrete_time"].items():
    lines.append(f"| {steps} | ≤ {_pm(figure['bits_per_token'], figure['stderr'])} |")
  lines.append(f"| ∞ (continuous) | ≤ {_nelbo(results)} |")
  return lines


def _loss_profile(results: dict) -> list[str]:
  """w(t)·CE per token by bin of t."""
  if "loss_profile" not in results:
    return []
  profile = results["loss_profile"]
  edges = profile["t_edges"]
  lines = [
    "",
    "## Per-t loss profile",
    "",
    f"w(t)·Σ masked CE per token with t uniform in each bin (one draw per bin and sequence; "
    f"{profile['schedule']} schedule). The mean over bins is a stratified estimate of "
    + (
      "the schedule's part of the bound (its endpoint terms, not shown, make up the rest)"
      if profile["endpoint_terms_excluded"]
      else "the continuous bound"
    )
    + f": {_pm(profile['mean_bits_per_token'], profile['mean_stderr'])} bits/token.",
    "",
    "| t | bits/token |",
    "|---|---|",
  ]
  for lo, hi, value, stderr in zip(edges, edges[1:], profile["bits_per_token"], profile["stderr"]):
    lines.append(f"| ({lo:.2f}, {hi:.2f}] | {_pm(value, stderr)} |")
  return lines


def _learned_schedule(results: dict) -> list[str]:
  """A learned schedule's exponent per token, the 20 largest and smallest past 40 tokens."""
  if "learned_schedule" not in results:
    return []
  learned = results["learned_schedule"]
  lines = [
    "",
    "## Learned masking schedule",
    "",
    f"{learned['schedule']}: α_v(t) = 1 − t^(w_v), learned with the model (GenMD4). A "
    "large w_v keeps token v visible longer (masked late, revealed early in sampling). "
    f"w ranges over [{learned['min']:.3f}, {learned['max']:.3f}] (std {learned['std']:.3f}); "
    "plots/learned_exponents.png draws them sorted.",
    "",
    "| token | id | w |",
    "|---|---|---|",
  ]
  rows = list(zip(learned["tokens"], learned["token_ids"], learned["exponents"]))
  shown = [f"| {repr(token)[1:-1]} | {token_id} | {w:.4f} |" for token, token_id, w in rows]
  return lines + (shown if len(shown) <= 40 else shown[:20] + ["| … | … | … |"] + shown[-20:])


def _judged_samples(results: dict) -> list[str]:
  """Fresh samples under the AR judge: generative perplexity beside their entropy."""
  if "generative_perplexity" not in results:
    return []
  sampler = ", ".join(f"{k}={v}" for k, v in results["sampler"].items() if v not in (None, ""))
  return [
    "",
    "## Samples under the judge",
    "",
    f"{results['num_judged_samples']} fresh samples ({sampler}) scored by the AR model of "
    f"`{results['judge_workdir']}`. A low generative perplexity with a low sample entropy "
    "is repetition, not quality: read them together.",
    "",
    "| Quantity | Value |",
    "|---|---|",
    f"| generative perplexity | {_pm(results['generative_perplexity'], results['generative_perplexity_stderr'])} |",
    f"| sample entropy (bits, unigram per sample) | "
    f"{_pm(results['sample_entropy'], results['sample_entropy_stderr'])} |",
  ]


def write(workdir, results: dict) -> pathlib.Path:
  """Writes WORKDIR/eval.md; returns its path."""
  path = workdir_lib.as_workdir(workdir).eval_md
  path.write_text(render(results))
  return path
