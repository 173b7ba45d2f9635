"""The KL-regularised optimum of a bigram reward on a generated language, exactly.

max_π E_π[r] − β KL(π ‖ p) is attained by π*(x) ∝ p(x) exp(r(x)/β). For a Markov language p and
a bigram reward r(x) = Σ_ℓ R[x_ℓ, x_ℓ+1], π* is a Markov chain whose transitions depend on the
position: a backward recursion gives them (docs/math.md, "The KL-regularised optimum"). The
post-training tests read a policy's samples against it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from md4jax.diffusion import groundtruth


def bigram_distance(tokens, chain: "PositionalChain") -> float:
  """Total variation between the bigram frequencies of samples tokens [N, L] (a first-order
  chain fitted to them, pooled over positions) and chain's expected ones."""
  tokens = np.asarray(tokens)
  vocab = chain.vocab_size
  if tokens.ndim != 2 or tokens.shape[1] != chain.length:
    raise ValueError(
      f"bigram_distance: samples of shape {list(tokens.shape)}, not [N, {chain.length}] (the "
      "chain's length: its pair laws depend on the position)."
    )
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
    raise ValueError(f"bigram_distance: token ids outside [0, {vocab}) (a mask id left?).")
  counts = np.zeros((vocab, vocab))
  np.add.at(counts, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
  return float(0.5 * np.abs(counts / counts.sum() - chain.bigram_frequencies()).sum())


class PositionalChain:
  """A Markov chain whose transition depends on the position: q(x) = q_1(x_1) Π_ℓ Q_ℓ[x_ℓ, x_ℓ+1].

  initial [V], transitions [L − 1, V, V] (float64 rows summing to 1); exact quantities in NumPy.
  """

  def __init__(self, initial, transitions):
    self.initial = np.asarray(initial, np.float64)
    self.transitions = np.asarray(transitions, np.float64)
    self.vocab_size = self.initial.shape[0]
    self.length = self.transitions.shape[0] + 1

  def marginals(self) -> np.ndarray:
    """The law of each position, [L, V]."""
    laws = [self.initial]
    for transition in self.transitions:
      laws.append(laws[-1] @ transition)
    return np.stack(laws)

  def pair_laws(self) -> np.ndarray:
    """The law of each adjacent pair (x_ℓ, x_ℓ+1), [L − 1, V, V]."""
    return self.marginals()[:-1, :, None] * self.transitions

  def bigram_frequencies(self) -> np.ndarray:
    """The expected share of each bigram among a sequence's L − 1 pairs, [V, V]: what a
    first-order chain fitted to many samples estimates (pooled over positions)."""
    return self.pair_laws().mean(0)

  def expected_reward(self, reward) -> float:
    """E_q[Σ_ℓ R[x_ℓ, x_ℓ+1]] of a bigram reward table R [V, V]."""
    return float((self.pair_laws() * np.asarray(reward, np.float64)).sum())

  def kl_to(self, language: groundtruth.MarkovLanguage) -> float:
    """KL(q ‖ p) in nats, p a MarkovLanguage of the same vocabulary."""
    total = _kl_rows(self.initial, language.initial)
    for marginal, transition in zip(self.marginals()[:-1], self.transitions):
      total += marginal @ _kl_rows(transition, language.transition)
    return float(total)

  def log_prob(self, x) -> np.ndarray:
    """Exact log q(x) of each sequence [B, L], float64."""
    x = np.asarray(x)
    positions = np.arange(self.length - 1)
    with np.errstate(divide="ignore"):
      steps = np.log(self.transitions[positions, x[:, :-1], x[:, 1:]]).sum(-1)
      return np.log(self.initial[x[:, 0]]) + steps

  @functools.partial(jax.jit, static_argnums=(0, 2))
  def sample(self, key, n: int):
    """n exact samples [n, L] int32 (inverse CDF on 32-bit words, as MarkovLanguage.sample)."""
    initial = groundtruth.thresholds(self.initial)
    transitions = groundtruth.thresholds(self.transitions)
    first_key, rest_key = jax.random.split(key)
    first = groundtruth.draw(initial, jax.random.bits(first_key, (n,), jnp.uint32))

    def step(previous, inputs):
      thresholds, bits = inputs
      token = groundtruth.draw(thresholds[previous], bits)
      return token, token

    bits = jax.random.bits(rest_key, (self.length - 1, n), jnp.uint32)
    _, rest = jax.lax.scan(step, first, (transitions, bits))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def kl_optimum(
  language: groundtruth.MarkovLanguage, reward, beta: float, length: int
) -> tuple[PositionalChain, float]:
  """(π*, log Z) for max_π E_π[Σ_ℓ R[x_ℓ, x_ℓ+1]] − β KL(π ‖ p) over sequences of `length`.

  K = P ⊙ exp(R/β); h_L = 1, h_ℓ = K h_ℓ+1; π*(x_1) ∝ p(x_1) h_1(x_1) and
  π*(x_ℓ+1 = w | x_ℓ = v) = K[v, w] h_ℓ+1(w) / h_ℓ(v). In log space, so that no R/β, however
  large, overflows or underflows a row to 0/0.
  """
  reward = np.asarray(reward, np.float64)
  vocab = language.vocab_size
  if reward.shape != (vocab, vocab):
    raise ValueError(f"The bigram reward must be [V, V] = [{vocab}, {vocab}], got {reward.shape}.")
  if not np.all(np.isfinite(reward)):
    raise ValueError("The bigram reward holds a NaN or an infinity.")
  if not beta > 0:
    raise ValueError(f"beta must be > 0 (the KL coefficient), got {beta}.")
  if length < 2:
    raise ValueError(f"length must be >= 2 for a bigram reward, got {length}.")
  with np.errstate(divide="ignore"):  # Impossible transitions: log 0 = −inf, kept impossible.
    log_kernel = np.log(language.transition) + reward / beta
    log_initial = np.log(language.initial)
  log_h = np.zeros(vocab)
  transitions = []
  for _ in range(length - 1):
    log_joint = log_kernel + log_h  # [v, w]: log K[v, w] h_ℓ+1(w)
    log_h = np.logaddexp.reduce(log_joint, axis=-1)
    transitions.append(np.exp(log_joint - log_h[:, None]))
  log_first = log_initial + log_h
  log_z = np.logaddexp.reduce(log_first)
  first = np.exp(log_first - log_z)
  return PositionalChain(first, np.stack(transitions[::-1])), float(log_z)


def _kl_rows(q: np.ndarray, p: np.ndarray) -> np.ndarray:
  """KL of each row of q to the same row of p (0 log 0 = 0; +inf where q leaves p's support)."""
  ratio = np.where(q > 0, q / np.where(p > 0, p, 1.0), 1.0)
  terms = np.where(q > 0, q * np.log(ratio), 0.0)
  return np.where(((q > 0) & (p == 0)).any(-1), np.inf, terms.sum(-1))
