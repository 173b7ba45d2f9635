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


def sequence_nats(params, tokens, key, *, model, config: ml_collections.ConfigDict,
                  estimator: str, t_sampling: str) -> jax.Array:
  """Per-sequence loss in nats [B]: one NELBO draw (mdm) or the exact NLL (ar)."""
  vocab_size = config.data.vocab_size
  if config.model.type == "ar":
    logits = model.apply({"params": params}, generate.ar_inputs(tokens, vocab_size))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).sum(-1)
  denoise_fn = lambda z_t, alpha_t: model.apply({"params": params}, z_t, alpha_t)
  return diffusion.nelbo(key, denoise_fn, tokens, schedules.get_schedule(config.diffusion.schedule),
                         mask_id=vocab_size, estimator=estimator, t_sampling=t_sampling)


def make_eval_fn(config: ml_collections.ConfigDict, model, mesh):
  """Jitted (params, tokens [b, L], key) -> per-sequence nats [b], averaged over MC draws."""
  num_draws = 1 if config.model.type == "ar" else config.eval.num_mc_samples

  def eval_fn(params, tokens, key):
    def add_draw(total, draw_key):
      # Uniform (not stratified) t keeps the sequences' estimates independent, so the
      # standard error over sequences is honest.
      nats = sequence_nats(params, tokens, draw_key, model=model, config=config,
                           estimator=config.eval.estimator, t_sampling="uniform")
      return total + nats, None
    total, _ = jax.lax.scan(add_draw, jnp.zeros(tokens.shape[0]), jax.random.split(key, num_draws))
    return total / num_draws

  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  return jax.jit(eval_fn, in_shardings=(replicated, batch, replicated), out_shardings=replicated)


def _mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
  stderr = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
  return float(values.mean()), float(stderr)


def evaluate(config: ml_collections.ConfigDict, eval_fn, params, source, mesh) -> dict:
  """NELBO bits/token of held-out sequences ± standard error, against the truth where known."""
  sequences = source.eval_sequences(config.eval.num_sequences)
  num_sequences, seq_len = sequences.shape
  chunk = config.eval.batch_size
  padded = np.concatenate([sequences, np.zeros((-num_sequences % chunk, seq_len), sequences.dtype)])
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 3)
  batch_sharding = NamedSharding(mesh, P("data"))
  nats = np.concatenate([
      np.asarray(eval_fn(params, jax.device_put(padded[i:i + chunk], batch_sharding),
                         jax.random.fold_in(key, i)))
      for i in range(0, len(padded), chunk)])[:num_sequences]
  bits = nats / (seq_len * math.log(2.0))
  mean, stderr = _mean_and_stderr(bits)
  results = {
      "nelbo_bits_per_token": mean,
      "nelbo_bits_per_token_stderr": stderr,
      "perplexity": 2.0 ** mean,
      "num_sequences": num_sequences,
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
