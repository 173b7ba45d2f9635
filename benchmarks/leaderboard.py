r"""The sampler leaderboard: every sampler and setting scored against the exact law, as Markdown, a
plot and JSON. Collapse cannot win it: beside the cross-entropy excess, each row has two
diversity columns from the same samples.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default   # ~1.5 min
  python -m md4jax.main --config=configs/default.py:bd3 --workdir=/tmp/md4jax_default_bd3
  python -m md4jax.main --config=configs/default.py:uniform --workdir=/tmp/md4jax_default_uniform
  python -m md4jax.main --config=configs/default.py:uniform_bd3 --workdir=/tmp/md4jax_uniform_bd3
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default_sc \
      --config.model.self_condition=True
  python -m md4jax.main --config=configs/default.py:uniform --workdir=/tmp/md4jax_default_uniform_sc \
      --config.model.self_condition=True
  python -m md4jax.main --config=configs/distill.py --mode=distill --workdir=/tmp/md4jax_student \
      --config.distill.init_from=/tmp/md4jax_default
  python -m md4jax.main --config=configs/distill.py --mode=distill \
      --workdir=/tmp/md4jax_oracle_student --config.distill.init_from=/tmp/md4jax_default \
      --config.distill.teacher=oracle
  python -m md4jax.main --config=configs/distill.py:uniform --mode=distill \
      --workdir=/tmp/md4jax_uniform_student --config.distill.init_from=/tmp/md4jax_default_uniform
  python benchmarks/leaderboard.py --workdir=/tmp/md4jax_default \
      --bd3_workdir=/tmp/md4jax_default_bd3 --uniform_workdir=/tmp/md4jax_default_uniform \
      --uniform_bd3_workdir=/tmp/md4jax_uniform_bd3 \
      --self_conditioned_workdir=/tmp/md4jax_default_sc \
      --uniform_self_conditioned_workdir=/tmp/md4jax_default_uniform_sc \
      --student_workdir=/tmp/md4jax_student --oracle_student_workdir=/tmp/md4jax_oracle_student \
      --uniform_student_workdir=/tmp/md4jax_uniform_student \
      --output=docs/results/sampler_leaderboard.md

On the generated language of configs/default.py the true law is known. For each setting:
  * excess: mean −log2 p(sample) per token minus the true entropy, ± SE over samples. A
    mode-seeking sampler (low temperature, greedy, top-p) draws likelier sequences and pushes it
    below 0: the cross-entropy alone rewards collapse, as generative perplexity does.
  * chain entropy Δ: the entropy of the first-order chain fitted to the samples' bigrams, minus
    the same statistic of exact samples (--references batches of the same size; their spread is
    the SE). Collapse pushes it below 0.
  * bigram TV Δ: the total-variation distance of the samples' bigram table to the true one,
    minus that of exact samples (± their spread). Any wrong law pushes it above 0.
A row is marked exact when the excess and the entropy are within 2 SE of 0 and the TV is not
2 SE above it (a lower TV than exact samples' is noise, not a wrong law). Each is measured with the exact
denoiser (the oracle: the sampler's own error) and with the transformer trained in --workdir
(adding the network's error); and the network calls (NFE, for the batch) and the seconds per
sample (the compiled program's one run, on this machine).

Fast-dLLM's approximate caches (cache prefix, dual) need a network's keys and values, so they
run with the trained network only; "none" is the exact block-wise decoding they approximate.
Block diffusion (--bd3_workdir, a trained configs/default.py:bd3 run): blocks of 16 tokens, each
by a method of `sample`: with the oracle on the window, with the block-causal network through
its exact KV cache. Uniform-state diffusion (--uniform_workdir, a trained configs/default.py:uniform
run): its samplers from uniform noise, with the uniform process's exact posterior as the oracle;
block diffusion under uniform noise (--uniform_bd3_workdir) likewise, block by block, the network
through its exact KV cache.
Self-conditioned networks (masked and uniform), SDTT's few-step students (from the default
network, or from the oracle as the first teacher) and DCD's (from the uniform network) add rows of the trained network only: their
samplers' oracle rows are the plain ones above.
"""

import dataclasses
import json
import math
import pathlib
import time

import jax
import numpy as np
from absl import app, flags

import md4jax
from md4jax import config as config_lib
from md4jax.diffusion import groundtruth
from md4jax.evaluation import estimates
from md4jax.sampling import decoder, samplers

_WORKDIR = flags.DEFINE_string(
  "workdir", None, "A trained configs/default.py run (its EMA params)."
)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Markdown file to write (a .png and .json beside it)."
)
_BD3_WORKDIR = flags.DEFINE_string(
  "bd3_workdir", None, "A trained configs/default.py:bd3 run: block diffusion's rows (optional)."
)
_UNIFORM_BD3_WORKDIR = flags.DEFINE_string(
  "uniform_bd3_workdir",
  None,
  "A trained configs/default.py:uniform_bd3 run: block diffusion under uniform noise (optional).",
)
_UNIFORM_WORKDIR = flags.DEFINE_string(
  "uniform_workdir",
  None,
  "A trained configs/default.py:uniform run: uniform-state rows (optional).",
)
_SELF_CONDITIONED_WORKDIR = flags.DEFINE_string(
  "self_conditioned_workdir",
  None,
  "A trained configs/default.py run with --config.model.self_condition=True (optional).",
)
_UNIFORM_SELF_CONDITIONED_WORKDIR = flags.DEFINE_string(
  "uniform_self_conditioned_workdir",
  None,
  "A trained configs/default.py:uniform run with --config.model.self_condition=True (optional).",
)
_STUDENT_WORKDIR = flags.DEFINE_string(
  "student_workdir",
  None,
  "A configs/distill.py run (--mode=distill) from --workdir: SDTT student rows (optional).",
)
_ORACLE_STUDENT_WORKDIR = flags.DEFINE_string(
  "oracle_student_workdir",
  None,
  "A configs/distill.py run with --config.distill.teacher=oracle: its student's rows (optional).",
)
_UNIFORM_STUDENT_WORKDIR = flags.DEFINE_string(
  "uniform_student_workdir",
  None,
  "A configs/distill.py:uniform run from --uniform_workdir: DCD student rows (optional).",
)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 256, "Samples per setting (one batch).")
_REFERENCES = flags.DEFINE_integer(
  "references", 32, "Batches of exact samples the diversity columns are measured against."
)
_SEED = flags.DEFINE_integer("seed", 1, "Sampling key.")
_FROM_JSON = flags.DEFINE_string(
  "from_json", None, "Rewrite --output's Markdown and plot from this JSON of an earlier run."
)
SIGNIFICANCE = 2.0  # A column is exact when it is within this many SE of 0.

# (family, label, sample() keyword arguments): every sampler at a few budgets.
SETTINGS = (
  [
    ("ancestral", f"ancestral T={t}", dict(method="ancestral", num_steps=t))
    for t in (4, 8, 16, 64, 256)
  ]
  + [("ancestral", "ancestral T=1000", dict(method="ancestral", num_steps=1000))]
  + [("jump", f"jump T={t}", dict(method="jump", num_steps=t)) for t in (16, 64, 1000)]
  + [("first_hitting", "first_hitting", dict(method="first_hitting"))]
  + [("confidence", f"confidence T={t}", dict(method="confidence", num_steps=t)) for t in (16, 64)]
  + [("threshold", f"threshold τ={h}", dict(method="threshold", threshold=h)) for h in (0.1, 0.9)]
  + [
    (
      "remdm",
      f"remdm cap η={e} T={t}",
      dict(method="remdm", remask="cap", remask_eta=e, num_steps=t),
    )
    for e, t in ((0.01, 64), (0.01, 256), (0.05, 256))
  ]
  + [
    (
      "remdm",
      "remdm rescale η=0.1 T=256",
      dict(method="remdm", remask="rescale", remask_eta=0.1, num_steps=256),
    ),
    ("remdm", "remdm confidence T=64", dict(method="remdm", remask="confidence", num_steps=64)),
    (
      "remdm",
      "remdm loop T=64 +64 at α=0.9",
      dict(
        method="remdm",
        remask="cap",
        remask_eta=0.02,
        num_steps=64,
        remask_loop=64,
        remask_loop_alpha=0.9,
      ),
    ),
  ]
  + [
    (
      "mode-seeking",
      "ancestral T=64, temperature 0.8",
      dict(method="ancestral", num_steps=64, temperature=0.8),
    ),
    (
      "mode-seeking",
      "ancestral T=64, top-p 0.9",
      dict(method="ancestral", num_steps=64, top_p=0.9),
    ),
    (
      "mode-seeking",
      "first_hitting, temperature 0.7",
      dict(method="first_hitting", temperature=0.7),
    ),
    (
      "mode-seeking",
      "confidence T=64, greedy",
      dict(method="confidence", num_steps=64, temperature=0.0),
    ),
  ]
  + [
    (
      "blocks, caches",
      f"blocks of 16, ancestral T=16, cache {cache}",
      dict(method="ancestral", num_steps=16, cache=cache, block_size=16),
    )
    for cache in ("none", "prefix", "dual")
  ]
)
# Block diffusion (configs/default.py:bd3): its blocks, each by one of `sample`'s methods.
BD3_SETTINGS = [
  (
    "block diffusion",
    f"block diffusion b=16, ancestral T={t}",
    dict(method="ancestral", num_steps=t),
  )
  for t in (16, 64)
] + [
  ("block diffusion", "block diffusion b=16, first_hitting", dict(method="first_hitting")),
  (
    "block diffusion",
    "block diffusion b=16, confidence T=16",
    dict(method="confidence", num_steps=16),
  ),
]

# Uniform-state diffusion (configs/default.py:uniform): its samplers (md4jax.sampling.uniform_state).
UNIFORM_SETTINGS = (
  [
    ("uniform-state", f"uniform ancestral T={t}", dict(method="ancestral", num_steps=t))
    for t in (4, 8, 16, 64, 256)
  ]
  + [
    ("uniform-state", f"uniform greedy_tail T={t}", dict(method="greedy_tail", num_steps=t))
    for t in (16, 64)
  ]
  + [
    ("uniform-state", f"uniform canvas T={t}", dict(method="canvas", num_steps=t)) for t in (16, 64)
  ]
)

# Block diffusion under uniform noise (configs/default.py:uniform_bd3): T steps in each block of 16.
UNIFORM_BD3_SETTINGS = [
  (
    "uniform block diffusion",
    f"uniform block diffusion b=16, ancestral T={t}",
    dict(method="ancestral", num_steps=t, process="uniform"),
  )
  for t in (4, 16, 64)
]


# Self-conditioning (model.self_condition; docs/math.md § 14): a masked step reads the estimate of
# its own state, two network calls (T = 32 spends the 64 calls of plain T = 64), or with passes=1
# the last step's, one call; a uniform step passes its estimate to the next.
SELF_CONDITIONED_SETTINGS = [
  ("self-conditioned", f"self-conditioned ancestral T={t}", dict(method="ancestral", num_steps=t))
  for t in (16, 32, 64)
]
STEPWISE_SELF_CONDITIONED_SETTINGS = [
  (
    "self-conditioned",
    f"self-conditioned ancestral, last step's estimate T={t}",
    dict(method="ancestral", num_steps=t),
  )
  for t in (16, 64)
]
UNIFORM_SELF_CONDITIONED_SETTINGS = [
  (
    "uniform self-conditioned",
    f"uniform self-conditioned ancestral T={t}",
    dict(method="ancestral", num_steps=t, process="uniform"),
  )
  for t in (16, 64, 256)
]
# SDTT students (configs/distill.py: rounds 64 -> 32 -> 16 -> 8 -> 4), at the teacher's budgets.
STUDENT_SETTINGS = [
  ("SDTT student", f"SDTT student T={t}", dict(method="ancestral", num_steps=t))
  for t in (4, 8, 16, 64)
]


UNIFORM_STUDENT_SETTINGS = [
  (
    "DCD student (uniform)",
    f"DCD student T={t}",
    dict(method="ancestral", num_steps=t, process="uniform"),
  )
  for t in (4, 8, 16, 64)
]


def _truth(language, length: int, n: int) -> tuple[np.ndarray, list]:
  """The true bigram frequencies π(a) T(a, b) (the chain is stationary) and batches of exact
  samples of n sequences."""
  table = language.initial[:, None] * language.transition
  keys = jax.random.split(jax.random.PRNGKey(10_000), _REFERENCES.value)
  return table, [np.asarray(language.sample(k, n, length)) for k in keys]


def _score(language, truth, denoise_fn, schedule, config, kwargs):
  """One setting's figures: its excess and diversity, NFE and seconds per sample."""
  length, vocab_size, n = config.data.seq_len, config.data.vocab_size, _NUM_SAMPLES.value
  mask_id = None if kwargs.get("process") == "uniform" else vocab_size  # Uniform: no mask.
  common = dict(batch_size=n, length=length, schedule=schedule, mask_id=mask_id)
  key = jax.random.PRNGKey(_SEED.value)
  run = jax.jit(lambda key: decoder.sample(key, denoise_fn, **common, **kwargs))
  compiled = run.lower(key).compile()
  start = time.perf_counter()
  tokens, info = jax.block_until_ready(compiled(key))
  seconds = time.perf_counter() - start
  samplers.check_logits(info, kwargs["method"])
  tokens = np.asarray(tokens)
  entropy = language.entropy(length) / (length * math.log(2.0))
  bits = -np.asarray(language.log_prob(tokens), np.float64) / (length * math.log(2.0))
  figures = {
    "nfe": int(info["nfe"]),
    "seconds_per_sample": seconds / n,
    "excess": float(bits.mean() - entropy),
    "stderr": float(bits.std(ddof=1) / math.sqrt(n)),
    **estimates.diversity(tokens, *truth),
  }
  figures["exact"] = _exact(figures)
  return figures


def _within(point, value: str, error: str) -> bool:
  return abs(point[value]) <= SIGNIFICANCE * point[error]


def _collapsed(point) -> bool:
  """The fitted chain's entropy is significantly below exact samples': mode-seeking."""
  return point["chain_entropy_excess"] < -SIGNIFICANCE * point["chain_entropy_stderr"]


def _exact(point) -> bool:
  """Excess and entropy within SIGNIFICANCE SE of 0, and the TV not above it."""
  return (
    _within(point, "excess", "stderr")
    and _within(point, "chain_entropy_excess", "chain_entropy_stderr")
    and point["bigram_tv_excess"] <= SIGNIFICANCE * point["bigram_tv_stderr"]
  )


def _cells(point) -> str:
  if point is None:
    return "— | — | — | — | —"
  return (
    f"{point['nfe']} | {point['excess']:+.4f} ± {point['stderr']:.4f} | "
    f"{point['chain_entropy_excess']:+.4f} ± {point['chain_entropy_stderr']:.4f} | "
    f"{point['bigram_tv_excess']:+.4f} ± {point['bigram_tv_stderr']:.4f} | "
    f"{'✓' if point['exact'] else ''}"
  )


def _markdown(rows, config, true_bits) -> str:
  header = "| NFE | excess | chain entropy Δ | bigram TV Δ | exact |"
  lines = [
    "# Sampler leaderboard: the exact law, and the diversity collapse cannot fake",
    "",
    f"configs/default.py's language: {config.data.vocab_size} tokens, length "
    f"{config.data.seq_len}, true entropy {true_bits:.4f} bits/token; {_NUM_SAMPLES.value} "
    "samples per setting. **excess**: mean −log2 p(sample) per token − the true entropy, ± SE "
    "over samples. **chain entropy Δ**: bits/token of the first-order chain fitted to the "
    "samples' bigrams, minus the same statistic of exact samples "
    f"({_REFERENCES.value} batches of {_NUM_SAMPLES.value}: their spread is the SE); "
    "**bigram TV Δ**: the total-variation distance of the samples' bigram table to the true "
    "one, minus that of exact samples. A mode-seeking sampler lowers the excess below 0 and "
    "the chain entropy with it. **exact** (✓): the excess and the entropy within "
    f"{SIGNIFICANCE:g} SE of 0, the TV not {SIGNIFICANCE:g} SE above it. NFE: network calls for the batch; s/sample on the machine that "
    "wrote this file, compilation excluded. Regenerate with the commands in "
    "`benchmarks/leaderboard.py`.",
  ]
  for which in ("oracle", "trained"):
    lines += [
      "",
      f"## With the {'exact denoiser (the oracle)' if which == 'oracle' else 'trained network'}",
      "",
      f"| sampler | family {header}" + (" s/sample |" if which == "trained" else ""),
      "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if which == "trained" else ""),
    ]
    for row in rows:
      point = row[which]
      timing = ""
      if which == "trained":
        timing = f" {point['seconds_per_sample'] * 1e3:.2f} ms |"
      lines.append(f"| {row['label']} | {row['family']} | {_cells(point)} |{timing}")
  return "\n".join(lines) + "\n"


def _frontier(points: list) -> list:
  """The best per network call once collapse is priced in: the points whose samples did not
  collapse that no other such point beats in both NFE and |excess|."""
  fair = [p for p in points if not _collapsed(p)]
  return [
    p
    for p in fair
    if not any(
      q["nfe"] <= p["nfe"]
      and abs(q["excess"]) <= abs(p["excess"])
      and (q["nfe"], abs(q["excess"])) != (p["nfe"], abs(p["excess"]))
      for q in fair
    )
  ]


def _plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  families = list(dict.fromkeys(row["family"] for row in rows))
  palette = plt.get_cmap("tab20").colors  # 20 distinct colours: dark then light of each hue.
  order = [*range(0, 20, 2), *range(1, 20, 2)]
  colors = {f: palette[order[i % 20]] for i, f in enumerate(families)}
  # Rows at one NFE spread a little by family, so their points do not pile up.
  spread = {f: 1.0 + 0.04 * (i - (len(families) - 1) / 2) for i, f in enumerate(families)}
  figure, axes = plt.subplots(1, 3, figsize=(18, 5.6))
  panels = (
    ("oracle", "excess", "exact denoiser: excess vs calls"),
    ("trained", "excess", "trained network: excess vs calls"),
    ("trained", "chain_entropy_excess", "trained network: diversity vs excess"),
  )
  for axis, (which, y, title) in zip(axes, panels):
    points = [
      dict(row[which], label=row["label"], family=row["family"]) for row in rows if row[which]
    ]
    for p in points:
      versus_excess = y == "chain_entropy_excess"
      x = p["excess"] if versus_excess else p["nfe"] * spread[p["family"]]
      error = p["chain_entropy_stderr"] if versus_excess else p["stderr"]
      color = colors[p["family"]]
      axis.errorbar(
        x, p[y], yerr=error, fmt="o", color=color, mfc=color if p["exact"] else "white", capsize=2
      )
    if y == "excess":
      for i, p in enumerate(sorted(_frontier(points), key=lambda p: p["nfe"])):
        axis.annotate(
          p["label"],
          (p["nfe"] * spread[p["family"]], p["excess"]),
          fontsize=7,
          # Neighbours on the frontier: above, below, further above, further below.
          xytext=(5, (10, -18, 26, -34)[i % 4]),
          textcoords="offset points",
          arrowprops={"arrowstyle": "-", "lw": 0.5},
        )
      axis.set_xscale("log")
      axis.set_xlabel("network calls (batch)")
      axis.set_ylabel("excess over the true entropy (bits/token)")
    else:
      axis.axvline(0.0, color="gray", lw=0.5)
      axis.set_xscale("symlog", linthresh=0.1)
      axis.set_xlabel("excess over the true entropy (bits/token)")
      axis.set_ylabel("fitted-chain entropy − exact samples' (bits/token)")
    axis.set_yscale("symlog", linthresh=0.1)  # Small figures readable, collapse still on scale.
    axis.margins(y=0.08)
    axis.axhline(0.0, color="gray", lw=0.5)
    axis.set_title(title)
  handles = [plt.Line2D([], [], marker="o", ls="", color=colors[f], label=f) for f in families] + [
    plt.Line2D([], [], marker="o", ls="", color="gray", mfc="white", label="not exact (2 SE)")
  ]
  figure.legend(
    handles=handles,
    loc="lower center",
    bbox_to_anchor=(0.5, 0.03),
    ncol=min(len(handles), 7),
    fontsize=8,
    frameon=False,
  )
  figure.text(
    0.5,
    0.01,
    "labels: the best per network call among the samplers that did not collapse",
    ha="center",
    fontsize=8,
  )
  figure.tight_layout(rect=(0, 0.06 + 0.04 * math.ceil(len(handles) / 7), 1, 1))
  figure.savefig(path, dpi=120)


def _rows(settings, language, truth, oracle, trained, schedule, config):
  """Each setting scored with the oracle (None: the trained network's rows only) and the network."""
  rows = []
  for family, label, kwargs in settings:
    network_only = oracle is None or kwargs.get("cache") in ("prefix", "dual")
    row = {"family": family, "label": label, **kwargs}
    row["oracle"] = (
      None if network_only else _score(language, truth, oracle, schedule, config, kwargs)
    )
    row["trained"] = _score(language, truth, trained, schedule, config, kwargs)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def _write(rows, config, true_bits: float, summary: dict):
  output = pathlib.Path(_OUTPUT.value)
  for row in rows:  # What a point counts as is this script's, not the run's.
    for which in ("oracle", "trained"):
      if row[which]:
        row[which]["exact"] = _exact(row[which])
  output.write_text(_markdown(rows, config, true_bits))
  output.with_suffix(".json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
  _plot(rows, output.with_suffix(".png"))


def _oracle_taught(settings):
  """The student rows of a student whose first teacher was the oracle."""
  return [
    (f"{family} (oracle teacher)", label.replace("student", "student (oracle teacher)"), kwargs)
    for family, label, kwargs in settings
  ]


def main(argv):
  del argv
  config = config_lib.load_config("default")
  if _FROM_JSON.value:
    summary = json.loads(pathlib.Path(_FROM_JSON.value).read_text())
    _write(summary.pop("rows"), config, summary["true_bits_per_token"], summary)
    return
  language = groundtruth.MarkovLanguage(
    config.data.vocab_size, seed=config.data.language_seed, concentration=config.data.concentration
  )
  truth = _truth(language, config.data.seq_len, _NUM_SAMPLES.value)
  oracle = language.denoise_fn(config.data.vocab_size)
  if not _WORKDIR.value:
    raise app.UsageError("--workdir (a trained configs/default.py run) is required.")
  run = md4jax.load(_WORKDIR.value, role="--workdir")
  schedule = run.schedule
  rows = _rows(SETTINGS, language, truth, oracle, run.denoise_fn, schedule, config)
  trained_step = {"default": run.step}
  for flag, settings, block_oracle in (
    (_BD3_WORKDIR, BD3_SETTINGS, oracle),
    (_UNIFORM_BD3_WORKDIR, UNIFORM_BD3_SETTINGS, language.uniform_denoise_fn()),
  ):
    if not flag.value:
      continue
    blocked = md4jax.load(flag.value, role=f"--{flag.name}")
    block = blocked.config.diffusion.block_size
    for family, label, kwargs in settings:
      row = {"family": family, "label": label, **kwargs}
      blocks = dict(kwargs, block_size=block)
      row["oracle"] = _score(language, truth, block_oracle, blocked.schedule, config, blocks)
      row["trained"] = _score(
        language, truth, blocked.denoise_fn, blocked.schedule, config, dict(blocks, cache="exact")
      )
      rows.append(row)
      print(json.dumps(row), flush=True)
    trained_step[flag.name.removesuffix("_workdir")] = blocked.step
  if _UNIFORM_WORKDIR.value:
    uniform = md4jax.load(_UNIFORM_WORKDIR.value, role="--uniform_workdir")
    settings = [(f, label, dict(k, process="uniform")) for f, label, k in UNIFORM_SETTINGS]
    rows += _rows(
      settings,
      language,
      truth,
      language.uniform_denoise_fn(),
      uniform.denoise_fn,
      uniform.schedule,
      config,
    )
    trained_step["uniform"] = uniform.step
  for flag, settings in (
    (_SELF_CONDITIONED_WORKDIR, SELF_CONDITIONED_SETTINGS),
    (_UNIFORM_SELF_CONDITIONED_WORKDIR, UNIFORM_SELF_CONDITIONED_SETTINGS),
    (_STUDENT_WORKDIR, STUDENT_SETTINGS),
    (_ORACLE_STUDENT_WORKDIR, _oracle_taught(STUDENT_SETTINGS)),
    (_UNIFORM_STUDENT_WORKDIR, UNIFORM_STUDENT_SETTINGS),
  ):
    if flag.value:  # The oracle's rows of these samplers are above: network rows only.
      other = md4jax.load(flag.value, role=f"--{flag.name}")
      rows += _rows(settings, language, truth, None, other.denoise_fn, other.schedule, config)
      trained_step[flag.name.removesuffix("_workdir")] = other.step
      if flag is _SELF_CONDITIONED_WORKDIR:  # One call a step, handing each estimate on.
        stepwise = dataclasses.replace(other.denoise_fn, passes=1)
        settings = STEPWISE_SELF_CONDITIONED_SETTINGS
        rows += _rows(settings, language, truth, None, stepwise, other.schedule, config)
  true_bits = language.entropy(config.data.seq_len) / (config.data.seq_len * math.log(2.0))
  if _OUTPUT.value:
    summary = {
      "trained_step": trained_step,
      "num_samples": _NUM_SAMPLES.value,
      "references": _REFERENCES.value,
      "true_bits_per_token": true_bits,
    }
    _write(rows, config, true_bits, summary)


if __name__ == "__main__":
  flags.mark_flag_as_required("output")
  app.run(main)
