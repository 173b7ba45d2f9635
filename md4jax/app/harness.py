"""md4jax as an EleutherAI lm-evaluation-harness model: `--model md4jax --model_args workdir=DIR`
(docs/lm_eval.md). Importing this module registers it; `python -m md4jax.lm_eval` is lm-eval's
command line with it registered, and `lm_eval.simple_evaluate(model=Md4jaxLM(workdir=DIR))` the
library way.

loglikelihood scores a continuation given its context with the context never masked: by
default −(the mean of `draws` NELBO draws), a lower bound on log p(continuation | context) in
expectation, with a standard error per request (`records`, and the JSONL file `se_path`).
likelihood=order gives the exact log-likelihood of the left-to-right autoregressive model the
denoiser defines, orders:K the importance-weighted bound over K random orders; an ar workdir's
is exact. loglikelihood_rolling sums such scores over windows of the context; generate_until
samples with md4jax's samplers and cuts at the `until` strings.
"""

import dataclasses
import json
import logging
import math
import pathlib
from typing import Optional

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from md4jax import config as config_lib
from md4jax.app import harness_generate, harness_model
from md4jax.app.harness_model import HarnessError
from md4jax.training import checkpoint

# Under lm-eval's logger, whose handler its command line sets up: the SE summary shows there.
logger = logging.getLogger("lm_eval.models.md4jax")

# model_arg -> the config key it sets (any other key: config.<section>.<key>=value).
CONFIG_ARGS = {
  "draws": "eval.num_mc_samples",
  "likelihood": "eval.likelihood",
  "estimator": "eval.estimator",
  "sampler": "sample.method",
  "steps": "sample.num_steps",
  "temperature": "sample.temperature",
}
HARNESS_ARGS = ("workdir", "seed", "se_path", "batch_size", "max_gen_toks", "rolling_context")
# lm-eval passes these to every model; JAX places the work on its own devices.
IGNORED_ARGS = ("max_batch_size", "device")
DEFAULT_BATCH_SIZE = 32  # Rows per call when lm-eval's batch size is "auto".
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until.


@dataclasses.dataclass(frozen=True)
class Row:
  """One window: tokens (at most data.seq_len) whose first `scored_from` are context."""

  tokens: np.ndarray
  scored_from: int


def _batch_size(value, shards: int) -> int:
  """lm-eval's batch size (an int, or "auto"/"auto:N": DEFAULT_BATCH_SIZE), rounded up to a
  multiple of the devices that split a batch."""
  size = value if isinstance(value, int) and not isinstance(value, bool) else None
  if isinstance(value, str) and value.isdigit():
    size = int(value)
  if size is None and value is not None and not str(value).startswith("auto"):
    raise HarnessError(f"batch_size={value!r}: give a positive integer or 'auto'.")
  size = DEFAULT_BATCH_SIZE if size is None else size
  if size < 1:
    raise HarnessError(f"batch_size={value!r}: give a positive integer or 'auto'.")
  return -(-size // shards) * shards


def _integer(options: dict, name: str, default: int) -> int:
  """The model_arg `name` (lm-eval parses "8" to 8), default if absent; HarnessError if not an
  integer."""
  value = options[name] if name in options else default
  if isinstance(value, bool) or not isinstance(value, int):
    raise HarnessError(f"{name}={value!r}: give an integer.")
  return value


@register_model("md4jax")
class Md4jaxLM(LM):
  """An md4jax workdir's EMA model (or a `harness_model.Loaded`, e.g. the exact oracle).

  model_args (docs/lm_eval.md): workdir; draws (NELBO draws a request, default the workdir's
  eval.num_mc_samples); likelihood (nelbo | order | orders:K); estimator; sampler, steps,
  temperature (generate_until); seed; se_path (JSONL of every request's score and SE);
  batch_size (rows a call); max_gen_toks; rolling_context (tokens of text each later rolling
  window reads, default half the context); any config.<section>.<key>=value.
  """

  def __init__(self, workdir: Optional[str] = None, loaded=None, **options):
    super().__init__()
    unknown = sorted(
      name
      for name in options
      if name not in (*CONFIG_ARGS, *HARNESS_ARGS, *IGNORED_ARGS) and not name.startswith("config.")
    )
    if unknown:
      raise HarnessError(
        f"unknown model_arg {', '.join(unknown)}; md4jax takes {', '.join(HARNESS_ARGS)}, "
        f"{', '.join(CONFIG_ARGS)} and config.<section>.<key>=value (docs/lm_eval.md)."
      )
    if (workdir is None) == (loaded is None):
      raise HarnessError("give the model_arg workdir=DIR (an md4jax workdir), and only it.")
    overrides = {key: options[name] for name, key in CONFIG_ARGS.items() if name in options}
    overrides.update(
      {n[len("config.") :]: v for n, v in options.items() if n.startswith("config.")}
    )
    try:
      if loaded is None:
        loaded = harness_model.load_workdir(workdir, overrides)
      else:
        loaded = _with_overrides(loaded, overrides)
    # Config validation, a tokenizer file, no readable checkpoint.
    except (ValueError, FileNotFoundError, checkpoint.CheckpointError) as e:
      raise HarnessError(" ".join(str(e).split())) from None
    self.loaded, self.config = loaded, loaded.config
    self.seq_len = self.config.data.seq_len
    if self.config.sample.cache != "none":
      raise HarnessError(
        f"config.sample.cache={self.config.sample.cache!r}: generate_until samples each request's "
        "own context length in one row; Fast-dLLM's caches take one prompt length a batch "
        "(md4jax.main --mode=sample offers them). Use sample.cache=none."
      )
    seed = _integer(options, "seed", 0)
    mesh = loaded.mesh
    self.batch_size = _batch_size(
      options["batch_size"] if "batch_size" in options else None,
      mesh.shape["data"] * mesh.shape["fsdp"],
    )
    self.max_gen_toks = _integer(options, "max_gen_toks", DEFAULT_MAX_GEN_TOKS)
    self.rolling_context = _integer(options, "rolling_context", self.seq_len // 2)
    if not 0 <= self.rolling_context < self.seq_len:
      raise HarnessError(
        f"rolling_context={self.rolling_context}: give 0 .. {self.seq_len - 1} (data.seq_len - 1)."
      )
    self.scorer = harness_model.Scorer(loaded, seed)
    self.generator = harness_generate.Generator(loaded, seed)
    self.se_path = pathlib.Path(options["se_path"]) if "se_path" in options else None
    if self.se_path is not None:
      self.se_path.parent.mkdir(parents=True, exist_ok=True)
      self.se_path.write_text("")  # This run's requests only.
    self.records: list[dict] = []  # Every request's score and standard error, in order.
    self._setting = {
      "likelihood": self.config.eval.likelihood if self.scorer.kind != "exact" else "exact",
      "draws": self.scorer.draws,
      "estimator": self.config.eval.estimator if self.scorer.kind == "nelbo" else None,
      "seed": seed,
    }

  # ---- Tokens ----
  def _encode(self, text: str) -> list:
    try:
      return [int(t) for t in self.loaded.tokenizer.encode(text)] if text else []
    except ValueError as e:
      raise HarnessError(f"cannot encode {text[:60]!r}: {' '.join(str(e).split())}") from None

  def _pair(self, context: str, continuation: str) -> tuple[list, list]:
    """(context ids, continuation ids): trailing spaces of the context move to the continuation
    and the pair is encoded whole, as lm-eval's own models do, so word boundaries tokenize as
    in running text."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids, whole = self._encode(context), self._encode(context + continuation)
    if whole[: len(context_ids)] == context_ids:
      return context_ids, whole[len(context_ids) :]
    return context_ids, self._encode(continuation)

  def _pair_row(self, context: str, continuation: str) -> tuple[Row, bool]:
    """The window of the pair (its context cut from the left to fit) and whether it was cut."""
    context_ids, continuation_ids = self._pair(context, continuation)
    if len(continuation_ids) > self.seq_len:
      raise HarnessError(
        f"a continuation of {len(continuation_ids)} tokens is longer than the model's context "
        f"(data.seq_len={self.seq_len}): {continuation[:60]!r}..."
      )
    keep = self.seq_len - len(continuation_ids)
    cut = len(context_ids) > keep
    context_ids = context_ids[len(context_ids) - keep :] if cut else context_ids
    return Row(np.asarray(context_ids + continuation_ids, np.int32), len(context_ids)), cut

  def rolling_rows(self, ids: list) -> list[Row]:
    """A text's windows: the first seq_len tokens unconditionally, then each next
    seq_len − rolling_context tokens given the rolling_context tokens before them."""
    rows = [Row(np.asarray(ids[: self.seq_len], np.int32), 0)] if ids else []
    start, step = self.seq_len, self.seq_len - self.rolling_context
    while start < len(ids):
      window = ids[start - self.rolling_context : start + step]
      rows.append(Row(np.asarray(window, np.int32), self.rolling_context))
      start += step
    return rows

  # ---- Scoring ----
  def score_rows(self, rows: list[Row]) -> dict:
    """{nats, stderr, greedy, num_tokens} [len(rows)] of the rows' scored tokens, batch by batch."""
    columns = {"nats": [], "stderr": [], "greedy": []}
    for start in range(0, len(rows), self.batch_size):
      chunk = rows[start : start + self.batch_size]
      tokens = np.zeros((self.batch_size, self.seq_len), np.int32)
      editable = np.zeros((self.batch_size, self.seq_len), bool)
      lengths = np.zeros(self.batch_size, np.int32)
      row_ids = np.zeros(self.batch_size, np.int32)
      for i, row in enumerate(chunk):
        n = len(row.tokens)
        tokens[i, :n], lengths[i] = row.tokens, n
        editable[i, row.scored_from : n] = True
        row_ids[i] = harness_model.row_id(tokens[i, :n], editable[i, :n])
      scores = self.scorer.score(harness_model.batch_of(tokens, editable, lengths), row_ids)
      for name in columns:
        columns[name].append(scores[name][: len(chunk)])
    out = {name: np.concatenate(v) if v else np.zeros(0) for name, v in columns.items()}
    out["num_tokens"] = np.asarray([len(r.tokens) - r.scored_from for r in rows], np.int64)
    empty = out["num_tokens"] == 0  # Nothing scored: log 1, exactly.
    out["nats"][empty], out["stderr"][empty], out["greedy"][empty] = 0.0, 0.0, True
    return out

  def _record(self, records: list[dict], request: str):
    records = [{"request": request, **record, **self._setting} for record in records]
    self.records += records
    if self.se_path is not None:
      with self.se_path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    stderr = np.asarray([r["stderr"] for r in records], np.float64)
    if len(stderr) and np.isfinite(stderr).any():
      logger.info(
        "md4jax %s: %d requests, %s; Monte Carlo SE per request: mean %.4f, max %.4f nats.",
        request,
        len(records),
        ", ".join(f"{k}={v}" for k, v in self._setting.items() if v is not None),
        np.nanmean(stderr),
        np.nanmax(stderr),
      )

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    pairs = [self._pair_row(*request.args) for request in requests]
    if any(cut for _, cut in pairs):
      logger.warning(
        "md4jax: %d of %d contexts were cut from the left to fit data.seq_len=%d with their "
        "continuation.",
        sum(cut for _, cut in pairs),
        len(pairs),
        self.seq_len,
      )
    scores = self.score_rows([row for row, _ in pairs])
    results, records = [], []
    for i, request in enumerate(requests):
      result = (-float(scores["nats"][i]), bool(scores["greedy"][i]))
      self.cache_hook.add_partial("loglikelihood", request.args, result)
      results.append(result)
      records.append(
        {
          "context": request.args[0],
          "continuation": request.args[1],
          "loglikelihood": result[0],
          "stderr": float(scores["stderr"][i]),
          "is_greedy": result[1],
          "num_tokens": int(scores["num_tokens"][i]),
        }
      )
    self._record(records, "loglikelihood")
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows = [self.rolling_rows(self._encode(request.args[0])) for request in requests]
    scores = self.score_rows([row for rows in windows for row in rows])
    results, records, start = [], [], 0
    for request, rows in zip(requests, windows):
      part = slice(start, start + len(rows))
      start += len(rows)
      result = -float(scores["nats"][part].sum())
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
      results.append(result)
      records.append(
        {
          "text": request.args[0],
          "loglikelihood": result,
          "stderr": math.sqrt(float((scores["stderr"][part] ** 2).sum())),  # Independent windows.
          "num_tokens": int(scores["num_tokens"][part].sum()),
          "num_windows": len(rows),
        }
      )
    self._record(records, "loglikelihood_rolling")
    return results

  # ---- Generation ----
  def generation_window(self, context_ids: list, max_gen_toks: int) -> tuple[list, int]:
    """(the context kept, tokens to generate): both within data.seq_len; when they do not fit,
    the context keeps at least its last half-window of tokens and the generation gets the rest."""
    keep = min(len(context_ids), max(self.seq_len - max_gen_toks, self.seq_len // 2))
    kept = context_ids[len(context_ids) - keep :] if keep else []
    return kept, max(0, min(max_gen_toks, self.seq_len - keep))

  def _temperature(self, gen_kwargs: dict) -> float:
    """The request's temperature if it names one, 0 (greedy) for do_sample=False, else the
    sampler's (model_arg temperature, or the workdir's sample.temperature)."""
    if "temperature" in gen_kwargs:
      return float(gen_kwargs["temperature"])
    if "do_sample" in gen_kwargs and gen_kwargs["do_sample"] is False:
      return 0.0
    return float(self.config.sample.temperature)

  def _text_after(self, context_ids: list, generated: np.ndarray) -> str:
    """The generated text, up to the model's end of document (EOS) if it wrote one."""
    generated = [int(t) for t in generated]
    eos = self.loaded.tokenizer.eos_id
    if eos is not None and eos in generated:
      generated = generated[: generated.index(eos)]
    decode = self.loaded.tokenizer.decode
    head, whole = decode(context_ids), decode(context_ids + generated)
    return whole[len(head) :] if whole.startswith(head) else decode(generated)

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    plans = []
    for request in requests:
      context, gen_kwargs = request.args
      until = gen_kwargs["until"] if "until" in gen_kwargs else []
      until = [until] if isinstance(until, str) else list(until)
      max_gen = int(
        gen_kwargs["max_gen_toks"] if "max_gen_toks" in gen_kwargs else self.max_gen_toks
      )
      kept, n = self.generation_window(self._encode(context), max_gen)
      plans.append((kept, n, until, self._temperature(gen_kwargs)))
    seen, repeats = {}, []  # lm-eval repeats a request to draw several samples of it.
    for kept, n, _, temperature in plans:
      same = (tuple(kept), n, temperature)
      repeats.append(seen[same] if same in seen else 0)
      seen[same] = repeats[-1] + 1
    texts = [""] * len(requests)
    for temperature in sorted({plan[3] for plan in plans}):
      group = [i for i, plan in enumerate(plans) if plan[3] == temperature and plan[1] > 0]
      generated = self.generator.generate(
        [plans[i][0] for i in group],
        [plans[i][1] for i in group],
        [repeats[i] for i in group],
        temperature,
        self.batch_size,
      )
      for i, tokens in zip(group, generated):
        texts[i] = self._text_after(plans[i][0], tokens)
    for i, (request, plan) in enumerate(zip(requests, plans)):
      for stop in plan[2]:
        if stop and stop in texts[i]:
          texts[i] = texts[i][: texts[i].index(stop)]
      self.cache_hook.add_partial("generate_until", request.args, texts[i])
    return texts


def _with_overrides(loaded: harness_model.Loaded, overrides: dict) -> harness_model.Loaded:
  """loaded with config keys set and validated (the network is kept as it is)."""
  config = loaded.config.copy_and_resolve_references()
  for name, value in overrides.items():
    harness_model.override(config, name, value)
  mesh = loaded.mesh
  config_lib.validate_config(config, mesh.devices.size, mesh.devices.flat[0].platform)
  return dataclasses.replace(loaded, config=config)
