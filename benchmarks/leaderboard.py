r"""The sampler leaderboard: every sampler and setting scored by its exact-law excess, as Markdown,
a plot and JSON.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default   # ~1.5 min
  python -m md4jax.main --config=configs/default.py:bd3 --workdir=/tmp/md4jax_default_bd3
  python benchmarks/leaderboard.py --workdir=/tmp/md4jax_default \
      --bd3_workdir=/tmp/md4jax_default_bd3 --output=docs/results/sampler_leaderboard.md

On the generated language of configs/default.py the true law is known, so a sample's
excess — mean −log2 p(sample) per token minus the true entropy per token, ± SE over samples —
is exact. It is measured twice for each setting: with the exact denoiser (the oracle: the
excess is the sampler's own error, 0 for an exact sampler) and with the transformer trained
in --workdir (the excess adds the network's error), so what an approximation costs is
separated from what the network costs. Also the network calls (NFE, for the batch) and the
seconds per sample (after one compile run, on this machine).

Fast-dLLM's approximate caches (`sample.cache`) decode block by block with the trained network
only (the oracle has no keys and values): "none" is the exact block-wise decoding they
approximate, so each cache's cost is its excess minus that of "none" at the same setting.

Block diffusion (--bd3_workdir, a trained configs/default.py:bd3 run): blocks of 16 tokens one
after another, each by a method of `sample`: with the oracle through the reference sampler,
with the block-causal network through its exact KV cache.
"""

import json
import math
import pathlib
import time

import jax
import numpy as np
from absl import app, flags

from md4jax import config_lib, modes
from md4jax.diffusion import groundtruth
from md4jax.sampling import block_sampler, prefix_cache, samplers
from md4jax.training import objective

_WORKDIR = flags.DEFINE_string(
  "workdir", None, "A trained configs/default.py run (its EMA params)."
)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Markdown file to write (a .png and .json beside it)."
)
_BD3_WORKDIR = flags.DEFINE_string(
  "bd3_workdir", None, "A trained configs/default.py:bd3 run: block diffusion's rows (optional)."
)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 512, "Samples per setting (one batch).")
_SEED = flags.DEFINE_integer("seed", 1, "Sampling key.")

# (label, sample() keyword arguments): every sampler at a few budgets.
SETTINGS = (
  [(f"ancestral T={t}", dict(method="ancestral", num_steps=t)) for t in (16, 64, 256, 1000)]
  + [(f"jump T={t}", dict(method="jump", num_steps=t)) for t in (16, 64, 1000)]
  + [("first_hitting", dict(method="first_hitting"))]
  + [(f"confidence T={t}", dict(method="confidence", num_steps=t)) for t in (16, 64)]
  + [(f"threshold τ={h}", dict(method="threshold", threshold=h)) for h in (0.1, 0.3, 0.9)]
  + [
    (f"remdm cap η={e} T={t}", dict(method="remdm", remask="cap", remask_eta=e, num_steps=t))
    for e, t in ((0.01, 64), (0.01, 256), (0.05, 256))
  ]
  + [
    (
      "remdm rescale η=0.1 T=256",
      dict(method="remdm", remask="rescale", remask_eta=0.1, num_steps=256),
    ),
    ("remdm confidence T=64", dict(method="remdm", remask="confidence", num_steps=64)),
    (
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
      f"blocks of 16, ancestral T=16, cache {cache}",
      dict(method="ancestral", num_steps=16, cache=cache, block_size=16),
    )
    for cache in prefix_cache.CACHES
  ]
)
# Block diffusion (configs/default.py:bd3): its block size, each block by one of `sample`'s methods.
BD3_SETTINGS = [
  (f"block diffusion b=16, ancestral T={t}", dict(method="ancestral", num_steps=t))
  for t in (16, 64)
] + [
  ("block diffusion b=16, first_hitting", dict(method="first_hitting")),
  ("block diffusion b=16, confidence T=16", dict(method="confidence", num_steps=16)),
]


def _score(language, denoise_fn, schedule, config, kwargs, network=None, block_size=0):
  """The excess of one setting; a cache setting runs network = (model, params) instead, and
  block_size > 0 block diffusion's sampler (cached where network is given)."""
  length, vocab_size, n = config.data.seq_len, config.data.vocab_size, _NUM_SAMPLES.value
  common = dict(batch_size=n, length=length, schedule=schedule, mask_id=vocab_size)
  if "cache" in kwargs:
    run = lambda key: prefix_cache.sample_with_cache(key, *network, **common, **kwargs)
  elif block_size and network is not None:
    run = lambda key: block_sampler.sample_blocks_cached(
      key, *network, block_size=block_size, context_length=length, **common, **kwargs
    )
  elif block_size:
    run = lambda key: block_sampler.sample_blocks(
      key, denoise_fn, block_size=block_size, **common, **kwargs
    )
  else:
    run = jax.jit(lambda key: samplers.sample(key, denoise_fn, **common, **kwargs))
  jax.block_until_ready(run(jax.random.PRNGKey(0)))
  start = time.perf_counter()
  tokens, info = jax.block_until_ready(run(jax.random.PRNGKey(_SEED.value)))
  seconds = time.perf_counter() - start
  samplers.check_logits(info, kwargs["method"])
  entropy = language.entropy(length) / (length * math.log(2.0))
  bits = -np.asarray(language.log_prob(np.asarray(tokens)), np.float64) / (length * math.log(2.0))
  return {
    "nfe": int(info["nfe"]),
    "seconds_per_sample": seconds / n,
    "excess": float(bits.mean() - entropy),
    "stderr": float(bits.std(ddof=1) / math.sqrt(n)),
  }


def _markdown(rows, config, true_bits) -> str:
  lines = [
    "# Sampler leaderboard: exact-law excess on the generated language",
    "",
    f"configs/default.py's language: {config.data.vocab_size} tokens, length "
    f"{config.data.seq_len}, true entropy {true_bits:.4f} bits/token; {_NUM_SAMPLES.value} "
    "samples per setting. Excess = mean −log2 p(sample) per token − the true entropy, ± SE "
    "(0 for an exact sampler with the oracle). NFE: network calls for the batch; s/sample on "
    "the machine that wrote this file, after one compile run. Regenerate with the commands in "
    "`benchmarks/leaderboard.py`.",
    "",
    "| sampler | NFE (oracle) | excess, oracle | NFE (trained) | excess, trained | s/sample, trained |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for row in rows:
    oracle, trained = row["oracle"], row["trained"]
    oracle_cells = (
      f"{oracle['nfe']} | {oracle['excess']:+.4f} ± {oracle['stderr']:.4f}" if oracle else "— | —"
    )
    lines.append(
      f"| {row['label']} | {oracle_cells} | {trained['nfe']} | {trained['excess']:+.4f} ± "
      f"{trained['stderr']:.4f} | {trained['seconds_per_sample'] * 1e3:.2f} ms |"
    )
  return "\n".join(lines) + "\n"


def _plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
  for axis, which in zip(axes, ("oracle", "trained")):
    for row in (row for row in rows if row[which]):
      point = row[which]
      axis.errorbar(point["nfe"], point["excess"], yerr=point["stderr"], fmt="o", capsize=2)
      axis.annotate(
        row["label"],
        (point["nfe"], point["excess"]),
        fontsize=6,
        xytext=(3, 3),
        textcoords="offset points",
      )
    axis.set_xscale("log")
    axis.axhline(0.0, color="gray", lw=0.5)
    axis.set_xlabel("network calls (batch)")
    axis.set_ylabel("excess over the true entropy (bits/token)")
    axis.set_title(f"{which} denoiser")
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def _block_diffusion_rows(language, oracle) -> list:
  config = config_lib.load_config("default:bd3")
  run = modes.Run(config, _BD3_WORKDIR.value)
  if run.restored_step is None:
    raise SystemExit(f"No checkpoint in {_BD3_WORKDIR.value}: train configs/default.py:bd3 first.")
  params, block_size = run.state.ema_params, config.diffusion.block_size
  schedule, rows = objective.schedule_of(params, config), []
  for label, kwargs in BD3_SETTINGS:
    network = (run.model, params)
    rows.append(
      {
        "label": label,
        **kwargs,
        "oracle": _score(language, oracle, schedule, config, kwargs, block_size=block_size),
        "trained": _score(
          language, None, schedule, config, kwargs, network=network, block_size=block_size
        ),
        "trained_step": run.restored_step,
      }
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main(argv):
  del argv
  config = config_lib.load_config("default")
  language = groundtruth.MarkovLanguage(
    config.data.vocab_size, seed=config.data.language_seed, concentration=config.data.concentration
  )
  run = modes.Run(config, _WORKDIR.value)
  if run.restored_step is None:
    raise SystemExit(f"No checkpoint in {_WORKDIR.value}: train configs/default.py there first.")
  params = run.state.ema_params
  trained = objective.sampling_denoiser(run.model, params, config)
  oracle = language.denoise_fn(config.data.vocab_size)
  schedule = objective.schedule_of(params, config)
  rows = []
  for label, kwargs in SETTINGS:
    rows.append(
      {
        "label": label,
        **kwargs,
        "oracle": None if "cache" in kwargs else _score(language, oracle, schedule, config, kwargs),
        "trained": _score(language, trained, schedule, config, kwargs, network=(run.model, params)),
      }
    )
    print(json.dumps(rows[-1]), flush=True)
  if _BD3_WORKDIR.value:
    rows += _block_diffusion_rows(language, oracle)
  true_bits = language.entropy(config.data.seq_len) / (config.data.seq_len * math.log(2.0))
  if _OUTPUT.value:
    output = pathlib.Path(_OUTPUT.value)
    output.write_text(_markdown(rows, config, true_bits))
    output.with_suffix(".json").write_text(
      json.dumps(
        {
          "trained_step": run.restored_step,
          "num_samples": _NUM_SAMPLES.value,
          "true_bits_per_token": true_bits,
          "rows": rows,
        },
        indent=1,
      )
    )
    _plot(rows, output.with_suffix(".png"))


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
