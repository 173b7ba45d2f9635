"""eval.likelihood: the exact likelihood of an mdm over orders of the evaluated rows, beside the
NELBO (`md4jax.diffusion.orders`, docs/math.md § 5b).

"order" scores the left-to-right order, an exact NLL of one autoregressive model; "orders:K" the
importance-weighted bound over K random orders, in expectation between the model's NLL and the
NELBO. Each costs K · L network calls per row, so only the final evaluation measures it.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax.diffusion import bounds, orders, schedules
from md4jax.evaluation import estimates
from md4jax.training import objective

# fold_in(the eval batch's key, this): the orders' draws, apart from every bound's.
_ORDERS_STREAM = 0x0D3E5


def parse_likelihood(text: str) -> tuple[str, int]:
  """eval.likelihood as (kind, orders): ("nelbo", 0), ("order", 1) (left to right) or
  ("orders", K) for "orders:K"; ValueError for anything else."""
  if text in ("nelbo", "order"):
    return text, int(text == "order")
  kind, _, count = str(text).partition(":")
  if kind == "orders" and count.isdigit() and int(count) > 0:
    return kind, int(count)
  raise ValueError(
    f'eval.likelihood must be "nelbo", "order" or "orders:K" (K >= 1), got {text!r}.'
  )


def enabled(config: ml_collections.ConfigDict) -> bool:
  return config.model.type == "mdm" and parse_likelihood(config.eval.likelihood)[0] != "nelbo"


def order_denoiser(params, batch: dict, *, model, config: ml_collections.ConfigDict):
  """denoise_fn(z, alpha) of the batch's rows as `orders` calls it: α the share shown."""
  network = objective.denoiser(model, params, batch, config=config)
  # Mask-rate schedules only (config validation): a t-conditioned network gets the t of α.
  to_time = bounds.time_argument(
    schedules.get_schedule(config.diffusion.schedule), config.model.time_input
  )
  return lambda z, alpha: network(z, to_time(alpha))


def nats(params, batch: dict, key, *, model, config: ml_collections.ConfigDict) -> jax.Array:
  """−log p of each row's editable tokens over the orders of config.eval.likelihood, nats [B]."""
  kind, num_orders = parse_likelihood(config.eval.likelihood)
  denoise_fn = order_denoiser(params, batch, model=model, config=config)
  tokens, editable = batch["tokens"], batch["editable"].astype(bool)
  kwargs = dict(mask_id=config.data.vocab_size, editable=editable)
  if kind == "order":
    return orders.order_nll(denoise_fn, tokens, jnp.arange(tokens.shape[1]), **kwargs)
  return orders.iw_orders_nll(
    jax.random.fold_in(key, _ORDERS_STREAM), denoise_fn, tokens, num_orders, **kwargs
  )


def results(config: ml_collections.ConfigDict, columns: dict, source) -> dict:
  """eval.json's figures of columns["order_nats"] ({} without it): bits/token ± SE, and paired
  with the same rows' NELBO (and their exact −log2 p where the law is known)."""
  if "order_nats" not in columns:
    return {}
  order, nelbo, num_tokens = columns["order_nats"], columns["nats"], columns["num_tokens"]
  figure = estimates.bits_per_token(order, num_tokens)
  difference = estimates.bits_per_token(order - nelbo, num_tokens)
  out = {
    "likelihood": config.eval.likelihood,
    "num_orders": parse_likelihood(config.eval.likelihood)[1],
    "order_bits_per_token": figure["bits_per_token"],
    "order_bits_per_token_stderr": figure["stderr"],
    "order_minus_nelbo_bits_per_token": difference["bits_per_token"],
    "order_minus_nelbo_bits_per_token_stderr": difference["stderr"],
  }
  if source.true_bits_per_token is not None:
    bits = order / (num_tokens * np.log(2.0))
    excess = bits - source.true_bits_per_token_of(columns["tokens"])
    out["order_excess_bits_per_token"], out["order_excess_bits_per_token_stderr"] = (
      estimates.mean_and_stderr(excess)
    )
  return out


def summary(results: dict) -> list[str]:
  """The line for the end of a run, if eval.likelihood measured one."""
  if "order_bits_per_token" not in results:
    return []
  return [
    f"{results['likelihood']} likelihood {results['order_bits_per_token']:.4f} ± "
    f"{results['order_bits_per_token_stderr']:.4f} bits/token (minus the NELBO, paired: "
    f"{results['order_minus_nelbo_bits_per_token']:+.4f} ± "
    f"{results['order_minus_nelbo_bits_per_token_stderr']:.4f})"
  ]
