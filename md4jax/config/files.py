"""Configs from files: md4jax's own (md4jax/configs/*.py, by name from any directory), any
config file by path, and the config a workdir saved (its config.json)."""

import importlib.util
import json
import pathlib
import sys

import ml_collections
from absl import app

from md4jax.config.base import base_config
from md4jax.config.presets import expand_preset
from md4jax.config.values import check

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def config_names() -> list[str]:
  """The names of md4jax's own configs."""
  return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


def config_path(argument: str) -> str:
  """--config's value as a file path: "NAME[:ARG]" (one of md4jax's configs), a file's path, or
  "configs/NAME.py[:ARG]" (md4jax's own, wherever the command runs). ValueError in one line for
  anything else."""
  path, colon, arg = argument.partition(":")
  given = pathlib.Path(path)
  if given.is_file():
    return argument
  # A bare name, or configs/NAME.py as the commands in the docs write it; another missing path
  # is an error, never a shipped config of the same name.
  ours = given.suffix == ".py" and given.parent.name == "configs" and not given.parent.parent.name
  name = given.stem if ours else path
  own = CONFIG_DIR / f"{name}.py"
  if not (name in config_names() and own.is_file()):
    named = "" if ("/" in name or name.endswith(".py")) else f", and no md4jax config {name!r}"
    raise ValueError(
      f"--config={argument!r}: no file {path!r}{named} (md4jax's: {', '.join(config_names())})."
    )
  return f"{own}{colon}{arg}"


def with_config_paths(argv: list[str]) -> list[str]:
  """argv with the value of --config (--config=V or --config V) resolved by `config_path`."""
  argv, resolved = list(argv), []
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      arg = "--config=" + config_path(arg[len("--config=") :])
    elif i and argv[i - 1] == "--config":
      arg = config_path(arg)
    resolved.append(arg)
  return resolved


def parse_flags(argv: list[str]) -> list[str]:
  """The programs' flags parser (absl's app.run(..., flags_parser=parse_flags)): --config's
  value resolved by `config_path` (one line and exit status 1 when it names nothing), then absl's
  own parsing."""
  try:
    argv = with_config_paths(argv)
  except ValueError as e:
    program = pathlib.Path(argv[0]).stem
    sys.exit(f"{'md4jax' if program == 'main' else f'md4jax.{program}'}: error: {e}")
  return app.parse_flags_with_usage(argv)


def load_config(name: str) -> ml_collections.ConfigDict:
  """The config `name` names (`config_path`), its model.preset expanded (`expand_preset`)."""
  path, _, arg = config_path(name).partition(":")
  spec = importlib.util.spec_from_file_location(f"md4jax_configs_{pathlib.Path(path).stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return expand_preset(module.get_config(arg) if arg else module.get_config())


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a workdir saved (its config.json) on top of base_config: a key an older version
  did not write keeps its base value, which leaves that version's model and run unchanged."""
  config = base_config()

  def merge(node, values: dict, prefix: str):
    for key, value in values.items():
      check(key in node, f"{prefix}{key} (in a saved config) is not a key of this md4jax version.")
      if isinstance(value, dict):
        merge(node[key], value, f"{prefix}{key}.")
      else:
        node[key] = value

  merge(config, saved, "")
  return expand_preset(config)


def workdir_config(path, role: str) -> ml_collections.ConfigDict:
  """The config the workdir `path` saved (its config.json, `from_saved`); ValueError in one line
  naming `role` (what named the path, e.g. "training.init_from") when there is none or it
  cannot be read."""
  config_json = pathlib.Path(path) / "config.json"
  if not config_json.is_file():
    missing = "" if pathlib.Path(path).is_dir() else " (the folder does not exist)"
    raise ValueError(
      f"{role}={str(path)!r}: no config.json there{missing}; name a workdir md4jax trained or "
      "converted (python -m md4jax.convert)."
    )
  try:
    saved = json.loads(config_json.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{role}={str(path)!r}: {config_json} is not JSON ({e}).") from None
  if not isinstance(saved, dict):
    raise ValueError(f"{role}={str(path)!r}: {config_json} holds no JSON object.")
  try:
    return from_saved(saved)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{role}={str(path)!r}: {config_json}: {e}") from None
