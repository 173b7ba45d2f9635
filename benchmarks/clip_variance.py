r"""The training loss's variance under BD3-LM's clipped schedules, to choose training.mask_rates:
for each range [β, ω], the loss (nats per token) of many draws on the same held-out rows, its
mean and its standard deviation across batches of --batch_size rows; one JSON line per range.

  python benchmarks/clip_variance.py --config=configs/default.py:bd3 --workdir=DIR \
      --ranges="0,1;0.3,0.8;0.45,0.95;0.2,0.6"

DIR is a trained run of the config (its EMA params). The means differ by design (each range
averages the integrand over its own mask rates); what BD3-LM minimises is the spread, which is
the noise of the gradient steps.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.training import objective

_CONFIG = flags.DEFINE_string("config", "configs/default.py:bd3", "The trained run's config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A trained run of --config.")
_RANGES = flags.DEFINE_string(
  "ranges", "0,1;0.3,0.8;0.45,0.95;0.2,0.6", "β,ω ranges, ';'-separated."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Rows per batch (one loss each).")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", 64, "Batches (draws) per range.")


def main(argv):
  del argv
  config = config_lib.load_config(_CONFIG.value.removeprefix("configs/").replace(".py", ""))
  run = modes.Run(config, _WORKDIR.value)
  if run.restored_step is None:
    raise SystemExit(f"No checkpoint in {_WORKDIR.value}.")
  batch = next(iter(run.source.eval_batches(_BATCH_SIZE.value, _BATCH_SIZE.value)))
  tokens_per_row = jnp.asarray(batch["editable"]).sum(-1)
  for text in _RANGES.value.split(";"):
    low, high = (float(v) for v in text.split(","))

    @jax.jit
    def loss(key, low=low, high=high):
      nats = objective.sequence_nats(
        run.state.ema_params,
        batch,
        key,
        model=run.model,
        config=config,
        estimator="standard",
        t_sampling="stratified",
        mask_rates=None if (low, high) == (0.0, 1.0) else (low, high),
      )
      return nats.sum() / tokens_per_row.sum()

    losses = np.asarray([loss(jax.random.PRNGKey(i)) for i in range(_NUM_BATCHES.value)])
    print(
      json.dumps(
        {
          "mask_rates": [low, high],
          "loss_mean": float(losses.mean()),
          "loss_std": float(losses.std(ddof=1)),
          "batches": _NUM_BATCHES.value,
          "rows": _BATCH_SIZE.value,
          "step": run.restored_step,
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
