"""A catalogue of bad inputs: each fails with one line that names the key or file (and line or
byte where it applies) and what would be valid, and leaves the workdir's checkpoints and
metrics as they were."""

import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_recovery import tiny  # pylint: disable=g-bad-import-order  (tests/ is on sys.path)

from md4jax.app import modes
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent
USER_ERRORS = (ValueError, FileNotFoundError, workdir_lib.WorkdirError, checkpoint.CheckpointError)
ALPHABET = "abcdefgh "  # The local corpus's characters: a char tokenizer of 9 symbols and EOS.


def snapshot(root) -> dict:
  return {
    str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(pathlib.Path(root).rglob("*"))
    if p.is_file()
  }


def _words(rng, count: int, alphabet: str = ALPHABET.strip()) -> str:
  return " ".join("".join(rng.choice(list(alphabet), rng.integers(2, 7))) for _ in range(count))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  """Training data: a local text file (one document per line) and a text8-format file."""
  root = tmp_path_factory.mktemp("corpora")
  rng = np.random.default_rng(0)
  (root / "local.txt").write_text("\n".join(_words(rng, 12) for _ in range(80)) + "\n")
  (root / "text8").write_text(_words(rng, 4000, "abcdefghijklmnopqrstuvwxyz"))
  return root


def _text_config(corpora, dataset: str):
  if dataset == "text8":
    return tiny(data__dataset="text8", data__path=str(corpora / "text8"), data__vocab_size=27)
  return tiny(
    data__dataset="localtext",
    data__path=str(corpora / "local.txt"),
    data__vocab_size=len(ALPHABET) + 1,
  )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpora):
  """Trained workdirs (checkpoints at 2 and 4, metrics, eval): markov, localtext and text8."""
  workdirs = {}
  for name, config in (
    ("markov", tiny()),
    ("localtext", _text_config(corpora, "localtext")),
    ("text8", _text_config(corpora, "text8")),
  ):
    # A few steps and a light evaluation: what matters is that they left files behind.
    config.num_train_steps, config.checkpoint_every_steps, config.log_every_steps = 4, 2, 2
    config.optimizer.warmup_steps = 1
    config.eval.discrete_steps, config.eval.profile_bins, config.eval.num_mc_samples = "", 0, 1
    workdirs[name] = tmp_path_factory.mktemp(name)
    modes.train_and_evaluate(config, workdirs[name])
  return workdirs


class Case:
  """A bad input: how to make it (files, config), which mode meets it, and the message."""

  def __init__(self, name, expected, base="markov", mode="train", overrides=None, prepare=None):
    self.name, self.expected, self.base, self.mode = name, expected, base, mode
    self.overrides, self.prepare = overrides or {}, prepare

  def __repr__(self):
    return self.name


def _write(relative: str, content):
  def prepare(env):
    path = env["corpora"] / relative
    if isinstance(content, bytes):
      path.write_bytes(content)
    else:
      path.write_text(content)

  return prepare


def _set(key_path: str, value):
  def prepare(env):
    env["overrides"][key_path] = value(env) if callable(value) else value

  return prepare


def _both(*steps):
  def prepare(env):
    for step in steps:
      step(env)

  return prepare


def _judge(edit):
  """A judge workdir: a copy of the trained localtext workdir whose config.json `edit` changes."""

  def prepare(env):
    judge = env["tmp"] / "judge"
    shutil.copytree(env["trained"]["localtext"], judge)
    config = json.loads((judge / "config.json").read_text())
    edit(config)
    (judge / "config.json").write_text(json.dumps(config))
    env["overrides"]["eval__judge_workdir"] = str(judge)

  return prepare


def _as_ar_with(**data):
  def edit(config):
    config["model"]["type"] = "ar"
    config["data"].update(data)

  return edit


CASES = [
  # Config values (types are checked when the flags are parsed: see the CLI test below).
  Case(
    "batch size zero", r"batch_size must be a positive integer, got 0", overrides={"batch_size": 0}
  ),
  Case(
    "unknown schedule",
    r"diffusion.schedule: Unknown schedule 'cosyne'; valid schedules: cosine",
    overrides={"diffusion__schedule": "cosyne"},
  ),
  Case(
    "odd head dim",
    r"model.model_dim=32 / model.num_heads=3 must be an even integer head dim",
    overrides={"model__num_heads": 3},
  ),
  Case(
    "negative learning rate",
    r"optimizer.learning_rate must be > 0, got -1.0",
    overrides={"optimizer__learning_rate": -1.0},
  ),
  Case(
    "mesh that does not fit",
    r"mesh .* cannot fill 8 devices: 8 is not divisible by 3",
    overrides={"mesh__data": 3, "mesh__fsdp": -1},
  ),
  Case("top-p above one", r"sample.top_p must be in \(0, 1\]", overrides={"sample__top_p": 1.5}),
  Case(
    "discrete steps not integers",
    r"eval.discrete_steps must be distinct positive integers .*'10,ten'",
    overrides={"eval__discrete_steps": "10,ten"},
  ),
  Case(
    "remat unknown",
    r"model.remat='all' is unknown; valid: none, full, save_dots",
    overrides={"model__remat": "all"},
  ),
  # Data files (the trained runs' own files, damaged in place).
  Case(
    "text8 binary file",
    r"text8 is not UTF-8 text: byte 4 \(line 1\) is b'\\xff'",
    base="text8",
    prepare=_write("text8", b"abcd\xff\xfe\x00\x01binary"),
  ),
  Case(
    "text8 empty file", r"text8 file .*text8 is empty", base="text8", prepare=_write("text8", "")
  ),
  Case(
    "text8 outside its alphabet",
    r"text8 is not text8-format \(only a-z and space allowed\): found "
    r"\[',', 'H', 'W'\], first at character 0",
    base="text8",
    prepare=_write("text8", "Hello, World"),
  ),
  Case(
    "local text not UTF-8",
    r"local.txt is not UTF-8 text: byte 23 \(line 3\) is b'\\xe9'",
    base="localtext",
    prepare=_write("local.txt", "abc abc\ndef def\nbad caf\xe9 line\n".encode("latin-1")),
  ),
  Case(
    "local binary file",
    r"local.txt is not UTF-8 text: byte 0 \(line 1\) is b'\\x89'",
    base="localtext",
    prepare=_write("local.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
  ),
  Case(
    "local empty file",
    r"local.txt holds 0 document\(s\); a train and a validation split need at "
    r"least 2",
    base="localtext",
    prepare=_write("local.txt", ""),
  ),
  Case(
    "local single giant line",
    r"local.txt holds 1 document\(s\)",
    base="localtext",
    prepare=_write("local.txt", "abc " * 250_000),
  ),
  Case(
    "local characters outside the alphabet",
    r"Characters outside the tokenizer's 9-symbol "
    r"alphabet: \['x', 'y', 'z'\]",
    base="localtext",
    prepare=_write("local.txt", "abc def\nxyz abc\n" * 20),
  ),
  Case(
    "local file gone",
    r"Corpus path '.*local.txt' does not exist",
    base="localtext",
    prepare=lambda env: (env["corpora"] / "local.txt").unlink(),
  ),
  Case(
    "JSONL missing field",
    r"docs.jsonl:2: no string field 'text' \(has \['body'\]\); set "
    r"config.data.text_field",
    base=None,
    prepare=_both(
      _write("docs.jsonl", '{"text": "ab"}\n{"body": "cd"}\n{"text": "ef"}\n'),
      _set("data__path", lambda env: str(env["corpora"] / "docs.jsonl")),
      _set("data__dataset", "localtext"),
    ),
  ),
  Case(
    "JSONL broken line",
    r"docs.jsonl:3: not valid JSON",
    base=None,
    prepare=_both(
      _write("docs.jsonl", '{"text": "ab"}\n{"text": "cd"}\n{"text": "e\n'),
      _set("data__path", lambda env: str(env["corpora"] / "docs.jsonl")),
      _set("data__dataset", "localtext"),
    ),
  ),
  Case(
    "folder with no text",
    r"Folder .*empty_folder holds no .txt/.jsonl files",
    base=None,
    prepare=_both(
      lambda env: (env["corpora"] / "empty_folder").mkdir(),
      _write("empty_folder/notes.csv", "a,b\n"),
      _set("data__path", lambda env: str(env["corpora"] / "empty_folder")),
      _set("data__dataset", "localtext"),
    ),
  ),
  Case(
    "conditional pair missing its response",
    r"pairs.jsonl:1: no string field 'response' "
    r"\(has \['answer', 'prompt'\]\); set config.data.response_field",
    base=None,
    prepare=_both(
      _write("pairs.jsonl", '{"prompt": "ab", "answer": "ba"}\n' * 3),
      _set("data__path", lambda env: str(env["corpora"] / "pairs.jsonl")),
      _set("data__dataset", "conditional"),
      _set("data__tokenizer", "byte"),
      _set("data__vocab_size", 257),
    ),
  ),
  # Tokenizer files.
  Case(
    "saved tokenizer corrupt",
    r"tokenizer.json is not a tokenizer file: not JSON",
    base="localtext",
    prepare=lambda env: (env["workdir"] / "tokenizer.json").write_text("{garbage"),
  ),
  Case(
    "tokenizer file missing",
    r"No tokenizer file at '.*missing/tokenizer.json'; give "
    r"config.data.tokenizer_path",
    base=None,
    prepare=_both(
      _set("data__path", lambda env: str(env["corpora"] / "local.txt")),
      _set("data__dataset", "localtext"),
      _set("data__tokenizer", "bpe"),
      _set("data__tokenizer_path", lambda env: str(env["corpora"] / "missing" / "tokenizer.json")),
    ),
  ),
  Case(
    "vocabulary size against the tokenizer",
    r"data.vocab_size=50 but the localtext tokenizer has "
    r"10 ids; set --config.data.vocab_size=10",
    base=None,
    prepare=_both(
      _set("data__path", lambda env: str(env["corpora"] / "local.txt")),
      _set("data__dataset", "localtext"),
      _set("data__vocab_size", 50),
    ),
  ),
  # Prompts.
  Case(
    "markov prompt out of range",
    r"sample.prompt='1 99' cannot be encoded: Prompt ids must be in "
    r"\[0, 8\)",
    mode="sample",
    overrides={"sample__prompt": "1 99", "sample__num_samples": 2},
  ),
  Case(
    "prompt the tokenizer cannot encode",
    r"sample.prompt='zzz' cannot be encoded: Characters "
    r"outside the tokenizer's 9-symbol alphabet",
    base="localtext",
    mode="sample",
    overrides={"sample__prompt": "zzz", "sample__num_samples": 2},
  ),
  Case(
    "prompt longer than the sample",
    r"sample.prompt is 20 tokens but samples are 16 "
    r"\(sample.length",
    mode="sample",
    overrides={"sample__prompt": " ".join(["1"] * 20), "sample__num_samples": 2},
  ),
  # Judges and checkpoints of other models.
  Case(
    "judge of another tokenizer",
    r"The judge .*judge was trained with data.tokenizer='byte', the "
    r"evaluated model with 'char'",
    base="localtext",
    mode="eval",
    prepare=_judge(_as_ar_with(tokenizer="byte")),
  ),
  Case(
    "judge that is a diffusion model",
    r"The judge in .*judge is model.type='mdm'; generative "
    r"perplexity needs an exact likelihood, an 'ar' model",
    base="localtext",
    mode="eval",
    prepare=_judge(lambda config: None),
  ),
  Case(
    "judge without checkpoints",
    r"eval.judge_workdir='.*judge': no checkpoint in .*judge/checkpoints\.$",
    base="localtext",
    mode="eval",
    prepare=_both(
      _judge(_as_ar_with()), lambda env: shutil.rmtree(env["tmp"] / "judge" / "checkpoints")
    ),
  ),
  Case(
    "judge folder that is no workdir",
    r"eval.judge_workdir='.*': no config.json there .*; name a workdir md4jax trained or "
    r"converted",
    mode="eval",
    overrides={"eval__judge_workdir": "/nonexistent"},
  ),
  Case(
    "checkpoint of another model",
    r"Cannot resume from the checkpoints in .*: this config changes "
    r"what they hold \(model.model_dim: 32 → 64; model.num_layers: 1 → 2\)",
    overrides={"model__num_layers": 2, "model__model_dim": 64},
  ),
  # Workdirs.
  Case(
    "workdir on a read-only path",
    r"Cannot write in the workdir /sys/kernel: .* Choose a --workdir "
    r"on a writable disk",
    base="read_only",
  ),
  Case(
    "workdir that is a file",
    r"Cannot create the workdir .*a_file: .*Choose a --workdir",
    base="a_file",
  ),
]
MODES = {
  "train": modes.train_and_evaluate,
  "eval": modes.evaluate_checkpoint,
  "sample": modes.sample_checkpoint,
}


@pytest.fixture
def restored_corpora(corpora):
  """The corpora folder as the trained runs saw it, whatever a case did to it."""
  saved = {p: p.read_bytes() for p in corpora.iterdir() if p.is_file()}
  yield corpora
  for path in list(corpora.iterdir()):
    if path not in saved:
      shutil.rmtree(path) if path.is_dir() else path.unlink()
  for path, content in saved.items():
    path.write_bytes(content)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_bad_input_gets_one_clear_line_and_leaves_the_workdir_alone(
  case, trained, restored_corpora, tmp_path
):
  assert len(CASES) >= 25
  if case.base == "read_only":
    workdir = pathlib.Path("/sys/kernel")  # sysfs: nothing can be created there, even by root.
    try:
      (workdir / "md4jax-probe").touch()
      pytest.skip("/sys/kernel is writable on this machine")
    except OSError:
      pass
  elif case.base == "a_file":
    workdir = tmp_path / "a_file"
    workdir.write_text("not a folder")
  elif case.base is None:  # A fresh run; a metrics file stands in for earlier work.
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
  else:
    workdir = tmp_path / "work"
    shutil.copytree(trained[case.base], workdir)
  config = (
    _text_config(restored_corpora, case.base) if case.base in ("localtext", "text8") else tiny()
  )
  env = {
    "corpora": restored_corpora,
    "workdir": workdir,
    "trained": trained,
    "tmp": tmp_path,
    "overrides": dict(case.overrides),
  }
  if case.prepare:
    case.prepare(env)
  for key, value in env["overrides"].items():
    *parents, leaf = key.split("__")
    target = config
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  before = snapshot(workdir) if workdir.is_dir() and case.base != "read_only" else None

  with pytest.raises(USER_ERRORS) as info:
    MODES[case.mode](config, workdir)
  message = str(info.value)
  assert re.search(case.expected, message), message
  assert "\n" not in message.strip(), message
  if (
    before is not None
  ):  # Nothing that was there changed or went (a fresh tokenizer cache may appear).
    after = snapshot(workdir)
    assert {name: after.get(name) for name in before} == before


def test_the_cli_prints_one_line_without_a_traceback(tmp_path):
  for flags, expected in (
    (["--config.num_train_steps=ten"], "num_train_steps"),
    (
      ["--config.data.dataset=localtext", f"--config.data.path={tmp_path / 'none'}"],
      "md4jax: error: Corpus path '",
    ),
  ):
    result = subprocess.run(
      [
        sys.executable,
        "-m",
        "md4jax.main",
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'work'}",
        *flags,
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode != 0 and expected in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
