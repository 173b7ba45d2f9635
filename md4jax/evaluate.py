"""Evaluation: NELBO or exact AR NLL, with a standard error.

It takes the params to use (the trainer passes the EMA params). Losses of the
two model types live here too, so training and evaluation score sequences the
same way.

The AR model scores all L tokens: its input is [BOS, x_0, ..., x_{L-2}] with
BOS = vocab_size (the id the denoiser's embedding reserves for the mask, which
a causal model never sees otherwise), and its target is x. Its NLL per token is
then comparable to the diffusion NELBO per token.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from md4jax import diffusion
from md4jax import generate
from md4jax import schedules


def sequence_nats(params, batch: dict, key, *, model, config: ml_collections.ConfigDict,
                  estimator: str, t_sampling: str) -> jax.Array:
  """Per-row loss in nats [B] over the editable tokens: a NELBO draw (mdm) or the exact NLL (ar).

  batch["editable"] excludes padding and a conditional example's prompt, which
  the model reads (same segment) but never predicts.
  """
  tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
  editable = batch["editable"].astype(bool)
  vocab_size = config.data.vocab_size
  if config.model.type == "ar":
    # Each document starts from BOS: a packed document never reads its predecessor's end.
    inputs = jnp.where(positions == 0, vocab_size, generate.ar_inputs(tokens, vocab_size))
    logits = model.apply({"params": params}, inputs, None, segments, positions)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return jnp.where(editable, nll, 0.0).sum(-1)
  denoise_fn = lambda z_t, alpha_t: model.apply({"params": params}, z_t, alpha_t, segments, positions)
  return diffusion.nelbo(key, denoise_fn, tokens, schedules.get_schedule(config.diffusion.schedule),
                         mask_id=vocab_size, editable=editable, estimator=estimator,
                         t_sampling=t_sampling)


def make_eval_fn(config: ml_collections.ConfigDict, model, mesh):
  """Jitted (params, batch, key) -> {nats [b] (mean of the MC draws), num_tokens [b], tokens [b, L]}."""
  num_draws = 1 if config.model.type == "ar" else config.eval.num_mc_samples

  def eval_fn(params, batch, key):
    def add_draw(total, draw_key):
      # Uniform (not stratified) t keeps the rows' estimates independent, so the
      # standard error over rows is honest.
      nats = sequence_nats(params, batch, draw_key, model=model, config=config,
                           estimator=config.eval.estimator, t_sampling="uniform")
      return total + nats, None
    rows = batch["tokens"].shape[0]
    total, _ = jax.lax.scan(add_draw, jnp.zeros(rows), jax.random.split(key, num_draws))
    return {"nats": total / num_draws, "num_tokens": batch["editable"].astype(jnp.int32).sum(-1),
            "tokens": batch["tokens"]}

  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return jax.jit(eval_fn, in_shardings=(replicated, batch, replicated), out_shardings=replicated)


def _mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
  stderr = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
  return float(values.mean()), float(stderr)


def per_token_and_stderr(nats: np.ndarray, num_tokens: np.ndarray) -> tuple[float, float]:
  """Σ nats / Σ tokens (per valid token, never per mask) and its delta-method standard error."""
  ratio = nats.sum() / num_tokens.sum()
  residual = nats - ratio * num_tokens
  n = len(nats)
  stderr = (math.sqrt((residual ** 2).sum() / (n * (n - 1))) / num_tokens.mean()
            if n > 1 else float("nan"))
  return float(ratio), float(stderr)


def device_batch(batch: dict, mesh) -> dict:
  """A process-local batch dict as global arrays sharded over the mesh's data axis."""
  sharding = NamedSharding(mesh, P("data"))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def evaluate(config: ml_collections.ConfigDict, eval_fn, params, source, mesh) -> dict:
  """NELBO bits/token of held-out rows ± standard error, against the truth where known."""
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 3)
  outputs = [jax.device_get(eval_fn(params, device_batch(batch, mesh), jax.random.fold_in(key, i)))
             for i, batch in enumerate(source.eval_batches(config.eval.num_sequences,
                                                           config.eval.batch_size))]
  nats, num_tokens, rows = (np.concatenate([o[k] for o in outputs])
                            for k in ("nats", "num_tokens", "tokens"))
  scored = num_tokens > 0  # Padding rows fill the last batch.
  nats, num_tokens = nats[scored][:config.eval.num_sequences], num_tokens[scored][:config.eval.num_sequences]
  per_token, stderr = per_token_and_stderr(nats, num_tokens)
  mean, stderr = per_token / math.log(2.0), stderr / math.log(2.0)
  results = {
      "nelbo_bits_per_token": mean,
      "nelbo_bits_per_token_stderr": stderr,
      "perplexity": 2.0 ** mean,
      "num_sequences": int(len(nats)),
      "num_tokens": int(num_tokens.sum()),
      "model_type": config.model.type,
  }
  if config.model.type == "ar":
    # The exact NLL; it is also stored as nelbo_* so readers of either model type work.
    results.update(nll_bits_per_token=mean, nll_bits_per_token_stderr=stderr, estimator="exact_nll",
                   num_mc_samples=0)
  else:
    results.update(estimator=config.eval.estimator, num_mc_samples=config.eval.num_mc_samples)
  if source.true_bits_per_token is not None:
    true_bits = source.true_bits_per_token
    sequences = rows[scored][:len(nats)]
    bits = nats / (num_tokens * math.log(2.0))
    # The excess over the exact −log2 p of the same sequences cancels their sampling noise.
    excess, excess_stderr = _mean_and_stderr(bits - source.true_bits_per_token_of(sequences))
    results.update(true_bits_per_token=true_bits, gap_percent=100.0 * (mean - true_bits) / true_bits,
                   excess_bits_per_token=excess, excess_bits_per_token_stderr=excess_stderr)
  return results


def summary(results: dict) -> str:
  """Human-readable lines for the end of a run."""
  name = "NLL" if results["model_type"] == "ar" else "NELBO"
  lines = [f"{name} {results['nelbo_bits_per_token']:.4f} ± {results['nelbo_bits_per_token_stderr']:.4f} "
           f"bits/token ({results['num_sequences']} held-out sequences, {results['estimator']})"]
  if "true_bits_per_token" in results:
    lines.append(f"exact entropy {results['true_bits_per_token']:.4f} bits/token; "
                 f"gap {results['gap_percent']:+.2f}% "
                 f"(paired excess {results['excess_bits_per_token']:.4f} ± "
                 f"{results['excess_bits_per_token_stderr']:.4f} bits/token)")
  return "\n".join(lines)
