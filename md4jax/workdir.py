"""The layout of a run's working directory: every file md4jax reads or writes there.

Modules that write into a workdir take a `Workdir` and use its paths, so the
layout lives here only:

  config.json        the run's config (written by training, read by a judge)
  metrics.jsonl      one record per logged training step
  eval.json, eval.md the latest evaluation and its report
  samples.jsonl      the latest samples
  frontier.json      the sampler sweep (--mode=frontier)
  trajectory.html, trajectory.gif   the first sample's reverse process
  plots/             PNG plots
  tensorboard/       TensorBoard event files
  tokenizer.json     the text tokenizer, reused on resume
  data_cache/        tokenized corpora
  checkpoints/       orbax checkpoints, one folder per step
  lock               held by the process that writes the workdir
"""

import dataclasses
import pathlib

from md4jax.tokenizer import TOKENIZER_FILE


@dataclasses.dataclass(frozen=True)
class Workdir:
  """Paths inside one run's working directory."""
  root: pathlib.Path

  def __init__(self, root):
    object.__setattr__(self, "root", pathlib.Path(root))

  def __fspath__(self) -> str:
    return str(self.root)

  def __str__(self) -> str:
    return str(self.root)

  @property
  def config_json(self) -> pathlib.Path:
    return self.root / "config.json"

  @property
  def metrics_jsonl(self) -> pathlib.Path:
    return self.root / "metrics.jsonl"

  @property
  def eval_json(self) -> pathlib.Path:
    return self.root / "eval.json"

  @property
  def eval_md(self) -> pathlib.Path:
    return self.root / "eval.md"

  @property
  def samples_jsonl(self) -> pathlib.Path:
    return self.root / "samples.jsonl"

  @property
  def frontier_json(self) -> pathlib.Path:
    return self.root / "frontier.json"

  @property
  def trajectory_html(self) -> pathlib.Path:
    return self.root / "trajectory.html"

  @property
  def trajectory_gif(self) -> pathlib.Path:
    return self.root / "trajectory.gif"

  @property
  def plots(self) -> pathlib.Path:
    return self.root / "plots"

  @property
  def tensorboard(self) -> pathlib.Path:
    return self.root / "tensorboard"

  @property
  def tokenizer(self) -> pathlib.Path:
    return self.root / TOKENIZER_FILE

  @property
  def data_cache(self) -> pathlib.Path:
    return self.root / "data_cache"

  @property
  def checkpoints(self) -> pathlib.Path:
    return self.root / "checkpoints"

  @property
  def lock(self) -> pathlib.Path:
    return self.root / "lock"

  def plot(self, name: str) -> pathlib.Path:
    """plots/<name>, the folder created on demand."""
    self.plots.mkdir(parents=True, exist_ok=True)
    return self.plots / name


def as_workdir(workdir) -> Workdir:
  """A Workdir from a path or a Workdir."""
  return workdir if isinstance(workdir, Workdir) else Workdir(workdir)
