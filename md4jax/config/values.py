"""What a config's keys may hold: the valid choices, and the checks config validation is made of,
each raising ValueError("Invalid config: ...") naming the key (md4jax.config.validation runs them).
"""

import functools

DATASETS = ("markov", "text8", "localtext", "conditional", "lm1b", "owt")
TOKENIZERS = ("char", "byte", "bpe")
PACKINGS = ("concat", "documents")
MODEL_TYPES = ("mdm", "ar")
LOSS_UNITS = ("nats", "bits")
DTYPES = ("float32", "bfloat16")
# text8: lowercase a-z and space, one id per character.
TEXT8_VOCAB_SIZE = 27


def key_value(config, name: str):
  """The value of a dotted key such as "eval.discrete_steps"."""
  return functools.reduce(getattr, name.split("."), config)


def parse_list(text: str, kind=int) -> tuple:
  """The comma-separated values of a config string, converted by `kind` ("" = none)."""
  return tuple(kind(part) for part in text.split(",") if part.strip())


OR_EMPTY = ' (or "" for none)'


def check_list(config, name: str, kind, allow_empty: bool, is_valid, what: str):
  """A comma-separated list key: parses, values valid and distinct."""
  text = key_value(config, name)
  try:
    values = parse_list(text, kind) if isinstance(text, str) else None
  except ValueError:
    values = None
  check(
    values is not None
    and (values or allow_empty)
    and all(map(is_valid, values))
    and len(set(values)) == len(values),
    f"{name} must be distinct {what} separated by commas{OR_EMPTY if allow_empty else ''}, "
    f"got {text!r}.",
  )
  return values


def check(condition: bool, message: str):
  """Raises ValueError("Invalid config: <message>") unless condition holds."""
  if not condition:
    raise ValueError(f"Invalid config: {message}")


def check_positive_int(config, name: str):
  """The dotted key `name` holds an int > 0 (a bool is not one)."""
  value = key_value(config, name)
  check(
    isinstance(value, int) and not isinstance(value, bool) and value > 0,
    f"{name} must be a positive integer, got {value!r}.",
  )


def check_choice(value, name: str, choices):
  """`value`, the value of the key `name`, is one of `choices`."""
  check(value in choices, f"{name}={value!r} is unknown; valid: {', '.join(choices)}.")
