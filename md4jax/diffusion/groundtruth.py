"""Generated languages with exact likelihoods, entropies and denoisers.

They are the ground truth of the tests and of the embedded default run: with
the exact conditional p(x_ℓ | visible tokens) as the denoiser, the continuous
NELBO equals the true −log p(x) in expectation, and a trained model's bound can
be read against the true entropy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Floor for log(0) in the oracle's logits: finite, and far below any real probability.
_LOG_FLOOR = 1e-30


class MarkovLanguage:
  """An order-1 Markov chain over `vocab_size` tokens, started from its stationary law.

  p(x) = π(x_1) Π_ℓ P(x_{ℓ−1}, x_ℓ). Rows of P are Dirichlet(concentration)
  draws (small concentration: peaked, predictable transitions), mixed with a
  `smoothing` share of the uniform law so that every transition is possible.
  """

  def __init__(
    self, vocab_size: int, seed: int = 0, concentration: float = 0.3, smoothing: float = 1e-3
  ):
    if vocab_size < 2:
      raise ValueError(f"vocab_size must be >= 2, got {vocab_size}.")
    if not concentration > 0 or not 0 < smoothing <= 1:
      raise ValueError(
        f"Need concentration > 0 and 0 < smoothing <= 1, got {concentration}, {smoothing}."
      )
    rng = np.random.default_rng(seed)
    rows = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
    self.vocab_size = vocab_size
    self.transition = (1.0 - smoothing) * rows + smoothing / vocab_size  # float64 [V, V]
    self.initial = _stationary(self.transition)  # float64 [V]

  @classmethod
  def from_transition(cls, transition, initial=None) -> "MarkovLanguage":
    """The chain of a given transition matrix [V, V], which may hold exact zeros and one-hot rows
    (degenerate laws, for tests); started from `initial` [V] (default: its stationary law)."""
    transition = np.asarray(transition, np.float64)
    if (
      transition.ndim != 2 or transition.shape[0] != transition.shape[1] or transition.shape[0] < 2
    ):
      raise ValueError(f"transition must be [V, V] with V >= 2, got shape {transition.shape}.")
    if np.any(transition < 0) or not np.allclose(transition.sum(-1), 1.0):
      raise ValueError("transition rows must be probabilities that sum to 1.")
    language = cls.__new__(cls)
    language.vocab_size = transition.shape[0]
    language.transition = transition
    language.initial = (
      _stationary(transition)
      if initial is None
      else np.asarray(initial, np.float64) / np.sum(initial)
    )
    return language

  # ---- Exact quantities (float64, NumPy) ----
  def entropy(self, length: int) -> float:
    """Exact H(x_1..x_length) in nats."""
    row_entropy = -_x_log_x(self.transition).sum(-1)
    marginal, total = self.initial, -_x_log_x(self.initial).sum()
    for _ in range(length - 1):
      total += marginal @ row_entropy
      marginal = marginal @ self.transition
    return float(total)

  @functools.partial(jax.jit, static_argnums=0)  # One compile per shape, not one per op.
  def log_prob(self, x) -> Array:
    """Exact log p(x) of each sequence [B] (in the default float precision)."""
    log_initial = jnp.log(jnp.asarray(self.initial))
    log_transition = jnp.log(jnp.asarray(self.transition))
    return log_initial[x[:, 0]] + log_transition[x[:, :-1], x[:, 1:]].sum(-1)

  # ---- Sampling ----
  @functools.partial(jax.jit, static_argnums=(0, 2, 3))
  def sample(self, key: Array, n: int, length: int) -> Array:
    """n exact samples of the chain, [n, length] int32.

    Inverse CDF on 32-bit integers: token k is drawn when k of its law's cumulative thresholds,
    rounded to multiples of 2^-32, are <= a uniform 32-bit draw, so each probability is exact
    to 2^-32 (no float32 Gumbel tail), from one random word per token instead of V.
    """
    initial, transition = thresholds(self.initial), thresholds(self.transition)
    first_key, rest_key = jax.random.split(key)

    first = draw(initial, jax.random.bits(first_key, (n,), jnp.uint32))

    def step(previous, bits):
      token = draw(transition[previous], bits)
      return token, token

    _, rest = jax.lax.scan(step, first, jax.random.bits(rest_key, (length - 1, n), jnp.uint32))
    return jnp.concatenate([first[:, None], rest.T], axis=1)

  @functools.partial(jax.jit, static_argnums=(0, 3, 4))
  def sample_many(self, key: Array, indices: Array, n: int, length: int) -> Array:
    """sample(fold_in(key, i), n, length) for each i of indices [C], in one call: [C, n, length]."""
    return jax.vmap(lambda i: self.sample(jax.random.fold_in(key, i), n, length))(indices)

  # ---- Exact denoiser ----
  def denoise_fn(self, mask_id: int, schedule=None):
    """The exact SUBS denoiser: logits of p(x_ℓ | visible tokens) at every position.

    Forward–backward over the chain, batched and jit-able. With a mask-rate
    schedule (or none) it ignores its second argument: the posterior given z_t
    does not depend on time. With a state-dependent schedule it is called as
    (z_t, t [B]) and a hidden position's evidence for value k is the
    probability 1 − α_k(t) that k would have been masked (docs/math.md, "The exact oracle").
    """
    state_dependent = schedule is not None and schedule.state_dependent
    if mask_id != self.vocab_size:
      raise ValueError(f"mask_id must be vocab_size ({self.vocab_size}), got {mask_id}.")
    initial = jnp.asarray(self.initial, jnp.float32)
    transition = jnp.asarray(self.transition, jnp.float32)

    def denoise(z_t: Array, time: Array = None) -> Array:
      hidden = schedule.mask_prob(time)[:, None, :].astype(jnp.float32) if state_dependent else 1.0
      return chain_posterior_logits(z_t, initial, transition, mask_id, hidden)

    return denoise

  def uniform_denoise_fn(self, editable=None):
    """The exact denoiser of the uniform-state process: logits of p(x_ℓ | z_t), called as
    (z_t [B, L] in [0, V), alpha_t [B], or [B, L]: each position's own, as block diffusion's
    denoiser is called); every position's evidence for value k is α [z_ℓ = k] + (1 − α)/V
    (docs/math.md § 13). editable: bool [B, L] or None; a False position was never noised, so
    its evidence is one-hot."""
    initial = jnp.asarray(self.initial, jnp.float32)
    transition = jnp.asarray(self.transition, jnp.float32)
    vocab_size = self.vocab_size

    def denoise(z_t: Array, alpha_t: Array) -> Array:
      seen = jax.nn.one_hot(z_t, vocab_size, dtype=jnp.float32)
      alpha = jnp.asarray(alpha_t, jnp.float32)
      alpha = alpha[:, None, None] if alpha.ndim == 1 else alpha[..., None]
      evidence = alpha * seen + (1.0 - alpha) / vocab_size
      if editable is not None:
        evidence = jnp.where(editable[..., None], evidence, seen)
      return posterior_logits(evidence, initial, transition)

    return denoise


def chain_posterior_logits(z_t: Array, initial: Array, transition: Array, mask_id: int, hidden=1.0):
  """log p(x_ℓ | z_t) [B, L, V] of the chain (initial [V], transition [V, V], jax arrays, so
  differentiable in them) at every position: forward–backward, visible tokens as evidence.

  hidden: a masked position's evidence for each value (1, or [B, 1, V] under a state-dependent
  schedule: the probability that the value would have been masked)."""
  vocab_size = transition.shape[-1]
  # evidence[b, ℓ, k] ∝ q(z_t,ℓ | x_ℓ = k): which tokens position ℓ may hold given z_t.
  evidence = jnp.where(
    (z_t == mask_id)[..., None], hidden, jax.nn.one_hot(z_t, vocab_size, dtype=transition.dtype)
  )
  return posterior_logits(evidence, initial, transition)


def posterior_logits(evidence: Array, initial: Array, transition: Array) -> Array:
  """log p(x_ℓ | z) [B, L, V] of the chain given each position's evidence [B, L, V] ∝ q(z_ℓ |
  x_ℓ = k), by forward–backward (the masked process's evidence is one-hot or `hidden`; the
  uniform process's α [z_ℓ = k] + (1 − α)/V)."""
  evidence = evidence.transpose(1, 0, 2)

  def forward(message, e):  # message: p(x_ℓ, visible before ℓ) up to a constant.
    # Visible tokens of probability 0 (a heuristic sampler can reveal such a pair) leave
    # nothing to condition on: the chain restarts from what is seen at ℓ.
    filtered = _normalized_or(message * e, e)
    return filtered @ transition, message

  first = jnp.broadcast_to(initial, evidence.shape[1:])
  _, predicted = jax.lax.scan(forward, first, evidence)  # [L, B, V], before seeing x_ℓ.

  def backward(message, e):  # message: p(visible after ℓ | x_ℓ) up to a constant.
    out = message
    return _normalized_or((e * message) @ transition.T, jnp.ones_like(message)), out

  last = jnp.ones(evidence.shape[1:], transition.dtype)
  _, future = jax.lax.scan(backward, last, evidence, reverse=True)
  # In a context of probability 0 the posterior is undefined; the oracle then keeps the
  # evidence from the left (and, failing that, what position ℓ itself allows).
  posterior = _normalized_or(
    predicted * future * evidence, _normalized_or(predicted * evidence, evidence)
  )
  return jnp.log(jnp.maximum(posterior, _LOG_FLOOR)).transpose(1, 0, 2)


def _normalized_or(weights: Array, fallback: Array) -> Array:
  """weights / their sum over the last axis; fallback / its sum where the weights are all 0."""
  total = weights.sum(-1, keepdims=True)
  fallback = fallback / fallback.sum(-1, keepdims=True)
  return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), fallback)


def thresholds(probs: np.ndarray) -> Array:
  """Cumulative thresholds [..., V - 1] uint32 of laws probs [..., V]: round(2^32 · P(token <= k))."""
  cumulative = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)[..., :-1]
  return jnp.asarray(np.minimum(np.round(cumulative * 2.0**32), 2.0**32 - 1).astype(np.uint32))


def draw(cumulative: Array, bits: Array) -> Array:
  """The tokens [...] int32 that uniform 32-bit words `bits` [...] draw from laws given by their
  cumulative thresholds [..., V − 1] (`thresholds`)."""
  return (bits[..., None] >= cumulative).sum(-1, dtype=jnp.int32)


def _x_log_x(p: np.ndarray) -> np.ndarray:
  """p log p, with 0 log 0 = 0."""
  return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def _stationary(transition: np.ndarray) -> np.ndarray:
  """Stationary distribution of a positive stochastic matrix (left eigenvector 1)."""
  values, vectors = np.linalg.eig(transition.T)
  vector = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
  return vector / vector.sum()
