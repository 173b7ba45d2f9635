"""What every sampler's step shares: the per-row keys, the time grid and the reveal probability
on it, the ranking of masked positions, the trajectory record, the bound on network calls and the
broken-logits check. Pure, traceable functions (but `check_logits`, which runs on the host).

Every draw of a sampler is per row: row b draws only from its own key keys[b], so its tokens do
not depend on the other rows, nor on the batch size (`md4jax.sampling.decoder`).
"""

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

TIME_GRIDS = ("uniform", "cosine")


def fold_in(keys, data) -> Array:
  """fold_in(keys[b], data) for every row, [B]."""
  return jax.vmap(jax.random.fold_in, (0, None))(keys, data)


def time_grid(num_steps: int, kind: str = "uniform") -> Array:
  """Times t_0 = 0 < t_1 < ... < t_T = 1, [T + 1]. "cosine" puts more steps near t = 0."""
  fraction = jnp.arange(num_steps + 1, dtype=jnp.float32) / num_steps
  if kind == "uniform":
    return fraction
  if kind == "cosine":
    return 1.0 - jnp.cos(0.5 * jnp.pi * fraction)
  raise ValueError(f"Unknown time grid {kind!r}; valid: {', '.join(TIME_GRIDS)}.")


def alphas(schedule, t, batch_size):
  """α(t) for every row, [B]."""
  return jnp.full((batch_size,), schedule.alpha(t), jnp.float32)


def reveal_probability(schedule, grid, step):
  """(α(s) − α(t)) / (1 − α(t)) from t = grid[step] to s = grid[step − 1]; 1 on the last step."""
  mask_t, mask_s = schedule.mask_prob(grid[step]), schedule.mask_prob(grid[step - 1])
  return jnp.where(step == 1, 1.0, (mask_t - mask_s) / mask_t)


def masked_scores(scores, masked):
  """Scores of masked positions, finite and above every unmasked position's (−inf): a NaN or
  −inf score (from broken logits) still ranks a masked position before any visible one."""
  lowest = jnp.finfo(jnp.float32).min
  return jnp.where(masked, jnp.nan_to_num(scores, nan=lowest, neginf=lowest), -jnp.inf)


def new_trajectory(z, num_records, vocab_size, top_k):
  """Empty recording of num_records steps: states [S + 1, B, L], top candidates [S, B, L, K], α [S, B]."""
  batch_size, length = z.shape
  top_k = min(top_k, vocab_size)
  return {
    "tokens": jnp.broadcast_to(z, (num_records + 1, batch_size, length)),
    "top_ids": jnp.zeros((num_records, batch_size, length, top_k), jnp.int32),
    "top_probs": jnp.zeros((num_records, batch_size, length, top_k), jnp.float32),
    "alphas": jnp.zeros((num_records, batch_size), jnp.float32),
  }


def record(trajectory, index, z_after, logits, alpha):
  """Stores step `index`: the state after it and the denoiser's top candidates. No-op if None."""
  if trajectory is None:
    return None
  top_probs, top_ids = jax.lax.top_k(
    jax.nn.softmax(logits, axis=-1), trajectory["top_ids"].shape[-1]
  )
  return {
    "tokens": trajectory["tokens"].at[index + 1].set(z_after),
    "top_ids": trajectory["top_ids"].at[index].set(top_ids),
    "top_probs": trajectory["top_probs"].at[index].set(top_probs),
    "alphas": trajectory["alphas"].at[index].set(alpha),
  }


def repeat_final(trajectory, z, nfe):
  """Recorded steps past the last call repeat the final state."""
  if trajectory is not None:
    after_end = jnp.arange(trajectory["tokens"].shape[0])[:, None, None] > nfe
    trajectory["tokens"] = jnp.where(after_end, z, trajectory["tokens"])
  return trajectory


# Network calls a method makes at most, for a batch of L positions and T steps. Every unfinished
# row reveals at least one masked position per call of the adaptive methods; confidence's
# "proportional" counts may reveal none on a step, and keep a mask until the last of its T steps.
def max_calls(
  method: str,
  length: int,
  num_steps: Optional[int],
  remask_loop: int = 0,
  reveal_counts: str = "schedule",
) -> int:
  if method in ("ancestral", "cached"):
    return num_steps
  if method == "remdm":
    return num_steps + remask_loop
  if method == "confidence" and reveal_counts == "proportional":
    return num_steps
  if method in ("jump", "confidence"):
    return min(num_steps, length)
  return length  # first_hitting, threshold.


def nonfinite_rows(logits, z, mask_id):
  """[B] bool: a masked position of the row got a NaN or +inf logit, or no finite one."""
  broken = jnp.isnan(logits).any(-1) | (logits == jnp.inf).any(-1) | ~jnp.isfinite(logits).any(-1)
  return (broken & (z == mask_id)).any(-1)


def first_bad_call(first_bad, call, bad_rows):
  """The index of the first call whose logits were broken (−1 while none was)."""
  return jnp.where((first_bad < 0) & bad_rows.any(), call, first_bad)


class NonFiniteLogitsError(ValueError):
  """The denoiser returned logits no token can be drawn from: the samples would be meaningless."""


def check_logits(info: dict, method: str):
  """Raises NonFiniteLogitsError if a call's logits at a masked position were broken (host side)."""
  call = int(info["nonfinite_call"])
  if call >= 0:
    raise NonFiniteLogitsError(
      f"sampler {method!r}: network call {call + 1} of {int(info['nfe'])} returned logits with a "
      "NaN or +inf, or no finite value, at a masked position: no token can be drawn from them."
    )
