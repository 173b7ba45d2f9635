"""A verifier for `post_training_arithmetic.py`'s sums: post_train.reward="sums_verifier:correct_sum".

It reads no stored answer: it parses each rollout's prompt "a+b=" and checks that the generated
span, up to its EOS, is a + b. The rollouts' ids are the benchmark's char tokenizer's: its
alphabet is ALPHABET (the characters of the sums, sorted) and EOS is the id after it.
"""

import numpy as np

ALPHABET = "+0123456789="
EOS = len(ALPHABET)


def correct_sum(rollouts: dict) -> np.ndarray:
  """1.0 for each rollout whose generated span is its prompt's sum and an EOS, else 0.0."""
  rewards = np.zeros(len(rollouts["tokens"]), np.float32)
  for row, (tokens, generated) in enumerate(zip(rollouts["tokens"], rollouts["generated"])):
    span = np.flatnonzero(generated)
    if not len(span) or tokens[span[-1]] != EOS:
      continue
    prompt = "".join(ALPHABET[i] for i in tokens[: span[0]])
    answer = tokens[span[:-1]]
    if (answer >= EOS).any():
      continue
    left, _, right = prompt.rstrip("=").partition("+")
    rewards[row] = "".join(ALPHABET[i] for i in answer) == str(int(left) + int(right))
  return rewards
