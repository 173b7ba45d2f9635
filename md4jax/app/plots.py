"""PNG plots from a workdir's files: training curves (metrics.jsonl), NELBO vs T, the per-t
loss profile and a learned schedule's exponents (eval.json), and the sample-quality frontier
(frontier.json).

They read only what the run wrote, so they can be redrawn for any workdir:
  python -c "from md4jax import plots; plots.write_all('/tmp/md4jax_tiny')"
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # Files only: no display needed.
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

from md4jax.runtime import workdir as workdir_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

# metrics.jsonl series drawn as training curves, each in its own panel.
CURVES = (
  "loss",
  "nelbo_bits_per_token",
  "grad_norm",
  "learning_rate",
  "exponent_std",
  "reward_mean",  # --mode=post_train's.
  "kl",
)


def _read_jsonl(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_curves(records: list[dict], path: pathlib.Path, eval_results: dict | None = None):
  """One panel per logged series against the step; the final eval bound and entropy as lines."""
  names = [name for name in CURVES if any(name in r for r in records)]
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
  for ax, name in zip(axes[0], names):
    points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
    ax.plot(*zip(*points), marker=".", label=f"train {name}")
    if name == "nelbo_bits_per_token" and eval_results:
      ax.axhline(eval_results["nelbo_bits_per_token"], color="C1", ls="--", label="eval (EMA)")
      if "true_bits_per_token" in eval_results:
        ax.axhline(eval_results["true_bits_per_token"], color="k", ls=":", label="true entropy")
      ax.legend(fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(name, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def nelbo_vs_steps(results: dict, path: pathlib.Path):
  """Discrete-T bounds with ±1 SE bars against T (log axis), and the continuous bound as a band."""
  table = results["discrete_time"]
  steps = [int(t) for t in table]
  values = [table[t]["bits_per_token"] for t in table]
  errors = [table[t]["stderr"] or 0.0 for t in table]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.errorbar(steps, values, yerr=errors, marker="o", capsize=3, label="discrete-T NELBO")
  mean, stderr = results["nelbo_bits_per_token"], results["nelbo_bits_per_token_stderr"] or 0.0
  ax.axhline(mean, color="C1", ls="--", label="continuous NELBO")
  ax.axhspan(mean - stderr, mean + stderr, color="C1", alpha=0.2)
  if "true_bits_per_token" in results:
    ax.axhline(results["true_bits_per_token"], color="k", ls=":", label="true entropy")
  ax.set_xscale("log")
  ax.set_xlabel("T (steps)")
  ax.set_ylabel("bits/token (upper bound)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def loss_profile(results: dict, path: pathlib.Path):
  """w(t)·CE per token by bin of t, ±1 SE: where in t the bound's bits are spent."""
  profile = results["loss_profile"]
  edges = profile["t_edges"]
  centers = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
  values, errors = profile["bits_per_token"], [e or 0.0 for e in profile["stderr"]]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.stairs(values, edges, label="w(t)·Σ masked CE / tokens")
  ax.errorbar(centers, values, yerr=errors, fmt="none", ecolor="C0", capsize=2)
  excluded = " (no endpoint terms)" if profile["endpoint_terms_excluded"] else ""
  ax.axhline(
    profile["mean_bits_per_token"],
    color="C1",
    ls="--",
    label=f"mean over t{excluded} = {profile['mean_bits_per_token']:.3f}",
  )
  if "true_bits_per_token" in results:
    ax.axhline(results["true_bits_per_token"], color="k", ls=":", label="true entropy")
  ax.set_xlim(0, 1)
  ax.set_xlabel(f"t ({profile['schedule']} schedule)")
  ax.set_ylabel("bits/token")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def learned_exponents(results: dict, path: pathlib.Path, max_labels: int = 60):
  """The learned schedule's w_v sorted, one bar per token labelled with its text: large w is
  masked late and revealed early (α_v = 1 − t^{w_v})."""
  learned = results["learned_schedule"]
  w, tokens = learned["exponents"], learned["tokens"]
  if len(w) > max_labels:  # Large vocabularies: the extremes only.
    half = max_labels // 2
    w, tokens = w[:half] + w[-half:], tokens[:half] + tokens[-half:]
  fig, ax = plt.subplots(figsize=(max(5, 0.22 * len(w)), 3.5))
  ax.bar(range(len(w)), w)
  ax.set_xticks(range(len(w)), [repr(t)[1:-1] or "·" for t in tokens], rotation=90, fontsize=7)
  ax.axhline(1.0, color="k", ls=":", lw=0.8, label="w = 1 (linear)")
  ax.set_ylabel("learned exponent w")
  ax.set_title(f"{learned['schedule']}: α_v(t) = 1 − t^w_v, sorted", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _frontier_panel(ax, results: dict, value: str, label: str):
  """One line per (method, num_steps) through its temperatures; the held-out data as a star."""
  lines = {}
  for point in results["points"]:
    lines.setdefault((point["method"], point["num_steps"], point.get("threshold")), []).append(
      point
    )
  for (method, steps, threshold), points in lines.items():
    points = sorted(points, key=lambda p: p["temperature"])
    name = (
      f"{method}, τ = {threshold:g}"
      if threshold is not None
      else method
      if steps is None
      else f"{method}, {steps} steps"
    )
    ax.errorbar(
      [p["sample_entropy"] for p in points],
      [p[value] for p in points],
      xerr=[p["sample_entropy_stderr"] for p in points],
      yerr=[p[f"{value}_stderr"] for p in points],
      marker="o",
      ms=3,
      capsize=2,
      label=name,
    )
    for p in points:
      ax.annotate(
        f"{p['temperature']:g}",
        (p["sample_entropy"], p[value]),
        fontsize=6,
        textcoords="offset points",
        xytext=(3, 3),
      )
  if "data" in results:
    ax.plot(
      results["data"]["sample_entropy"], results["data"][value], "k*", ms=10, label="held-out data"
    )
  ax.set_xlabel("sample entropy (bits, unigram per sample)")
  ax.set_ylabel(label)
  ax.legend(fontsize=7)


def _excess_per_call_panel(ax, results: dict):
  """Exact-law excess (bits/token over the true entropy) against network calls, at temperature 1:
  the lowest curve is the sampler that buys the most quality per call."""
  lines = {}
  for point in results["points"]:
    if point["temperature"] == 1.0:
      lines.setdefault(point["method"], []).append(point)
  for method, points in lines.items():
    points = sorted(points, key=lambda p: p["nfe"])
    ax.errorbar(
      [p["nfe"] for p in points],
      [p["true_bits_per_token"] - results["true_bits_per_token"] for p in points],
      yerr=[p["true_bits_per_token_stderr"] for p in points],
      marker="o",
      ms=3,
      capsize=2,
      label=method,
    )
  ax.axhline(0.0, color="k", ls=":", lw=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("network calls per batch (NFE)")
  ax.set_ylabel("excess over the true entropy (bits/token)")
  ax.set_title("temperature 1", fontsize=8)
  ax.legend(fontsize=7)


def draw_frontier(results: dict, path: pathlib.Path):
  """Perplexity (judge and/or true law) against sample entropy, labels are temperatures; with a
  known law, also the exact-law excess against NFE."""
  panels = [
    (value, label)
    for value, label in (
      ("generative_perplexity", "generative perplexity (AR judge)"),
      ("true_perplexity", "perplexity under the true law"),
    )
    if value in results["points"][0]
  ]
  per_call = "true_bits_per_token" in results and any(
    p["temperature"] == 1.0 for p in results["points"]
  )
  fig, axes = plt.subplots(
    1, len(panels) + per_call, figsize=(5.5 * (len(panels) + per_call), 4), squeeze=False
  )
  for ax, (value, label) in zip(axes[0], panels):
    _frontier_panel(ax, results, value, label)
  if per_call:
    _excess_per_call_panel(axes[0][-1], results)
  fig.suptitle(f"{results['num_samples']} samples per point; labels: temperature", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_all(workdir, frontier: bool = True) -> list[pathlib.Path]:
  """Draws every plot the workdir's files allow into WORKDIR/plots/; returns their paths.

  frontier=False leaves plots/frontier.png to --mode=frontier (training redraws the rest).
  """
  workdir = workdir_lib.as_workdir(workdir)
  out = workdir.plots
  out.mkdir(parents=True, exist_ok=True)
  eval_path = workdir.eval_json
  results = json.loads(eval_path.read_text()) if eval_path.is_file() else None
  written = []
  metrics_path = workdir.metrics_jsonl
  records = _read_jsonl(metrics_path) if metrics_path.is_file() else []
  if any(name in r for r in records for name in CURVES):
    training_curves(records, out / "training_curves.png", results)
    written.append(out / "training_curves.png")
  if results and results.get("discrete_time"):
    nelbo_vs_steps(results, out / "nelbo_vs_steps.png")
    written.append(out / "nelbo_vs_steps.png")
  if results and results.get("loss_profile"):
    loss_profile(results, out / "loss_profile.png")
    written.append(out / "loss_profile.png")
  if results and results.get("learned_schedule"):
    learned_exponents(results, out / "learned_exponents.png")
    written.append(out / "learned_exponents.png")
  frontier_path = workdir.frontier_json
  if frontier and frontier_path.is_file():
    draw_frontier(json.loads(frontier_path.read_text()), out / "frontier.png")
    written.append(out / "frontier.png")
  return written
