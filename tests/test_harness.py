"""The lm-evaluation-harness model (md4jax.app.harness): its scores are md4jax's own bounds
of the same rows, the context is never masked, more draws shrink the SE, rolling windows are
the documented rows, generation stops at `until`; with the exact oracle the left-to-right and
K-order likelihoods are the exact conditional NLL and the NELBO is above it; local YAML tasks
run offline through lm_eval.simple_evaluate and its command line."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # Read when datasets is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

import oracles  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from md4jax import config as config_lib  # noqa: E402
from md4jax import rng  # noqa: E402
from md4jax.app import harness, harness_model, harness_tasks, modes  # noqa: E402
from md4jax.data import sources  # noqa: E402
from md4jax.data import tokenizer as tokenizer_lib  # noqa: E402
from md4jax.diffusion import orders  # noqa: E402
from md4jax.evaluation import likelihoods  # noqa: E402
from md4jax.runtime import sharding  # noqa: E402
from md4jax.runtime import workdir as workdir_lib  # noqa: E402
from md4jax.training import checkpoint, objective  # noqa: E402
from md4jax.training import state as state_lib  # noqa: E402

SEQ_LEN, VOCAB = 16, 8  # configs/tiny.py's.


def tiny_config():
  config = config_lib.load_config("tiny")
  config.eval.num_sequences, config.eval.discrete_steps, config.eval.profile_bins = 16, "", 0
  config.sample.num_samples = 0
  return config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """configs/tiny.py trained 20 steps by md4jax.main's train mode, in process."""
  path = tmp_path_factory.mktemp("tiny")
  modes.train_and_evaluate(tiny_config(), path)
  return path


@pytest.fixture(scope="module")
def lm(workdir):
  return harness.Md4jaxLM(workdir=str(workdir), draws=4, seed=3, batch_size=8)


@pytest.fixture(scope="module")
def language():
  return sources.MarkovSource(tiny_config()).language


def text(ids) -> str:
  return " ".join(str(int(t)) for t in ids)


def request(kind: str, *args) -> Instance:
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def pairs(rows, context_length: int) -> list[Instance]:
  """loglikelihood requests: each row's first context_length ids, then the rest."""
  return [
    request("loglikelihood", text(r[:context_length]), " " + text(r[context_length:])) for r in rows
  ]


def sequences(language, n: int, length: int, seed: int = 0) -> np.ndarray:
  return np.asarray(language.sample(jax.random.PRNGKey(seed), n, length))


@pytest.fixture(scope="module")
def oracle(lm, language):
  """The language's exact denoiser in the trained network's place (no params)."""
  return dataclasses.replace(one_device(lm.loaded, oracles.OracleDenoiser(language)), params={})


def one_device(loaded: harness_model.Loaded, model=None) -> harness_model.Loaded:
  """loaded on a mesh of one device (a debug callback then sees whole batches)."""
  mesh = sharding.make_mesh(loaded.config, jax.devices()[:1])
  params = jax.device_put(loaded.params, sharding.replicated(mesh))
  return harness_model.Loaded(loaded.config, model or loaded.model, params, loaded.tokenizer, mesh)


def md4jax_draws(lm, batch: dict, keys, row_index=None) -> np.ndarray:
  """objective.sequence_nats of the workdir's model on the batch, one draw per key [K, B]."""
  config = lm.config

  def draw(key):
    return objective.sequence_nats(
      lm.loaded.params,
      batch,
      key,
      model=lm.loaded.model,
      config=config,
      estimator=config.eval.estimator,
      t_sampling="uniform",
      row_index=row_index,
    )

  return np.asarray(jax.jit(jax.vmap(draw))(jnp.stack(keys)), np.float64)


def test_loglikelihood_is_md4jax_bound_of_the_same_draws(lm, language):
  # Whole rows (context + continuation = seq_len): the direct computation needs no padding.
  rows = sequences(language, 5, SEQ_LEN)
  results = lm.loglikelihood(pairs(rows, 9))
  editable = np.broadcast_to(np.arange(SEQ_LEN) >= 9, rows.shape)
  batch = {**sources.dense_batch(rows), "editable": editable}
  row_index = jnp.asarray([harness_model.row_id(r, e) for r, e in zip(rows, editable)])
  key = rng.stream(3, harness_model.KEY_STREAM)
  draws = md4jax_draws(lm, batch, [jax.random.fold_in(key, k) for k in range(4)], row_index)
  np.testing.assert_allclose([-ll for ll, _ in results], draws.mean(0), rtol=1e-5, atol=1e-5)
  stderr = [record["stderr"] for record in lm.records[-5:]]
  np.testing.assert_allclose(stderr, draws.std(0, ddof=1) / 2, rtol=1e-3, atol=1e-6)
  assert all(record["num_tokens"] == 7 and record["stderr"] > 0 for record in lm.records[-5:])


def test_padded_rows_score_as_the_shorter_rows_alone(lm, language):
  # Rows of 9 tokens ride in windows of 16 with padding; 256 draws of the same 9-token rows
  # without padding give the same law (other masks: the padding changes the row's shape).
  rows = sequences(language, 4, 9, seed=1)
  many = harness.Md4jaxLM(loaded=lm.loaded, draws=64, seed=4, batch_size=8)
  results = many.loglikelihood(pairs(rows, 4))
  batch = sources.dense_batch(np.repeat(rows, 64, 0))  # Each row 64 times.
  batch["editable"] = np.broadcast_to(np.arange(9) >= 4, batch["tokens"].shape)
  direct = md4jax_draws(lm, batch, list(jax.random.split(jax.random.PRNGKey(100), 4)))
  direct = direct.reshape(4 * 4, 64).T.reshape(64 * 4, 4)  # [draws, rows].
  direct_mean, direct_se = direct.mean(0), direct.std(0, ddof=1) / np.sqrt(len(direct))
  for i, (loglikelihood, _) in enumerate(results):
    gap, stderr = -loglikelihood - direct_mean[i], many.records[i]["stderr"]
    assert abs(gap) < 4 * np.hypot(stderr, direct_se[i]), (gap, stderr, direct_se[i])


class Spy:
  """The network with every input it is called on recorded (a debug callback)."""

  def __init__(self, model, seen: list):
    self.model, self.seen = model, seen

  def __getattr__(self, name):
    return getattr(self.model, name)

  def apply(self, variables, z, *args, **kwargs):
    jax.debug.callback(lambda z: self.seen.append(np.asarray(z)), z)
    return self.model.apply(variables, z, *args, **kwargs)


@pytest.mark.parametrize("likelihood", ["nelbo", "orders:2"])
def test_context_positions_are_never_masked(lm, language, likelihood):
  seen = []
  spied = one_device(lm.loaded, Spy(lm.loaded.model, seen))
  scorer = harness.Md4jaxLM(loaded=spied, draws=3, likelihood=likelihood, batch_size=4)
  rows = sequences(language, 3, 12, seed=2)
  scorer.loglikelihood(pairs(rows, 7))
  assert seen, "the network was never called"
  mask_id = VOCAB
  masked_continuation = False
  for z in seen:
    for i, row in enumerate(rows):
      np.testing.assert_array_equal(z[i, :7], row[:7])  # The context, as given, at every call.
      masked_continuation |= bool((z[i, 7:12] == mask_id).any())
    assert not (z[3:] == mask_id).any()  # Filler rows: nothing to score.
  assert masked_continuation  # The check above ran on calls that did mask something.
  assert any((z[:3, 7:12] == mask_id).all() for z in seen)  # is_greedy's call: all masked.


def test_more_draws_shrink_the_standard_error(lm, language):
  rows = sequences(language, 8, SEQ_LEN, seed=3)
  requests = pairs(rows, 6)
  stderr = {}
  for draws in (4, 64):
    scorer = harness.Md4jaxLM(loaded=lm.loaded, draws=draws, batch_size=8)
    scorer.loglikelihood(requests)
    stderr[draws] = np.asarray([record["stderr"] for record in scorer.records])
  assert (stderr[4] > 0).all() and (stderr[64] > 0).all()
  assert stderr[64].mean() < stderr[4].mean() / 2  # √16 = 4 in expectation.


def test_rolling_is_the_unconditional_bound_then_the_documented_windows(lm, language):
  short, long = sequences(language, 1, 12, seed=4)[0], sequences(language, 1, 40, seed=5)[0]
  rolled = lm.loglikelihood_rolling(
    [request("loglikelihood_rolling", text(short)), request("loglikelihood_rolling", text(long))]
  )
  assert lm.records[-1]["num_windows"] == 4 and lm.records[-1]["num_tokens"] == 40
  # One window: the whole text, nothing visible; the same row as an empty context's.
  (alone, _), *windows = lm.loglikelihood(
    [request("loglikelihood", "", text(short))]
    + [request("loglikelihood", "", text(long[:16]))]
    + [
      request("loglikelihood", text(long[start - 8 : start]), " " + text(long[start : start + 8]))
      for start in (16, 24, 32)
    ]
  )
  assert rolled[0] == pytest.approx(alone, rel=1e-6)
  assert rolled[1] == pytest.approx(sum(w for w, _ in windows), rel=1e-6)


def generations(lm, context: str, *untils, n: int = 10) -> list[str]:
  """generate_until of the context once per `until` list, n tokens at most."""
  kwargs = [{"until": until, "max_gen_toks": n} for until in untils]
  return lm.generate_until([request("generate_until", context, k) for k in kwargs])


def test_generation_stops_at_until_and_keeps_its_draws(lm):
  (free,) = generations(lm, "1 2 3 4", [])
  ids = free.split()
  assert len(ids) == 10 and all(0 <= int(t) < VOCAB for t in ids) and free.startswith(" ")
  stop = ids[3]  # A token that occurs after the first: the cut shortens the text.
  cut, again = generations(lm, "1 2 3 4", [f" {stop}"], ["\n"])
  assert cut == free[: free.index(f" {stop}")] and len(cut) < len(free)
  assert again != free  # lm-eval's repeats: an equal request draws afresh.
  assert len(generations(lm, "1 2 3 4", [], n=2)[0].split()) == 2


def test_exact_oracle_orders_are_the_exact_nll_and_the_nelbo_is_above_it(oracle, language):
  rows = sequences(language, 48, SEQ_LEN, seed=6)
  requests = pairs(rows, 8)
  exact = -np.asarray(language.log_prob(rows) - language.log_prob(rows[:, :8]), np.float64)
  for likelihood in ("order", "orders:3"):
    scorer = harness.Md4jaxLM(loaded=oracle, likelihood=likelihood, batch_size=16)
    got = -np.asarray([ll for ll, _ in scorer.loglikelihood(requests)])
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
  scorer = harness.Md4jaxLM(loaded=oracle, draws=8, batch_size=16)
  nelbo = -np.asarray([ll for ll, _ in scorer.loglikelihood(requests)])
  excess = nelbo - exact
  se = excess.std(ddof=1) / np.sqrt(len(excess))
  assert excess.mean() > -3 * se and excess.mean() < 2.0  # A bound, in expectation.


def test_orders_scores_are_md4jax_iw_bound_of_the_same_orders(lm, language):
  rows = sequences(language, 3, SEQ_LEN, seed=7)
  scorer = harness.Md4jaxLM(loaded=lm.loaded, likelihood="orders:3", seed=2, batch_size=8)
  got = scorer.loglikelihood(pairs(rows, 10))
  editable = np.broadcast_to(np.arange(SEQ_LEN) >= 10, rows.shape)
  batch = {**sources.dense_batch(rows), "editable": editable}
  config = scorer.config.copy_and_resolve_references()
  denoise_fn = likelihoods.order_denoiser(
    lm.loaded.params, batch, model=lm.loaded.model, config=config
  )
  row_index = jnp.asarray([harness_model.row_id(r, e) for r, e in zip(rows, editable)])
  expected = orders.iw_orders_nll(
    rng.stream(2, harness_model.KEY_STREAM),
    denoise_fn,
    jnp.asarray(rows),
    3,
    mask_id=VOCAB,
    editable=jnp.asarray(editable),
    row_index=row_index,
  )
  np.testing.assert_allclose([-ll for ll, _ in got], expected, rtol=1e-5, atol=1e-5)


def test_is_greedy_is_the_argmax_with_the_continuation_masked(lm, language):
  rows = sequences(language, 8, SEQ_LEN, seed=8)
  # Each row's own argmax continuation, read off the network, is greedy; one token changed is not.
  z = np.where(np.arange(SEQ_LEN) >= 12, VOCAB, rows)
  denoise_fn = objective.sampling_denoiser(lm.loaded.model, lm.loaded.params, lm.config)
  argmax = np.asarray(jnp.argmax(denoise_fn(jnp.asarray(z), jnp.zeros(8)), -1))
  best = np.where(np.arange(SEQ_LEN) >= 12, argmax, rows)
  other = best.copy()
  other[:, 13] = (other[:, 13] + 1) % VOCAB
  results = lm.loglikelihood(pairs([*best, *other], 12))
  assert [g for _, g in results] == [True] * 8 + [False] * 8


def saved_init(config, path) -> str:
  """A workdir whose one checkpoint is config's initial state (what md4jax.convert writes)."""
  mesh = sharding.make_mesh(config)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(path).checkpoints, 1)
  state = state_lib.init_state(config, model, optimizer, mesh)
  checkpoint.save(manager, 0, state, {"next_batch_index": 0}, config)
  checkpoint.wait(manager)
  workdir_lib.Workdir(path).config_json.write_text(config.to_json_best_effort(indent=2))
  return str(path)


def test_an_ar_workdir_is_scored_exactly_and_samples(language, tmp_path):
  config = config_lib.load_config("tiny_ar")
  ar = harness.Md4jaxLM(workdir=saved_init(config, tmp_path), draws=4, batch_size=8)
  rows = sequences(language, 3, 12, seed=10)
  results = ar.loglikelihood(pairs(rows, 5))
  batch = {**sources.dense_batch(rows), "editable": np.broadcast_to(np.arange(12) >= 5, rows.shape)}
  exact = objective.sequence_nats(
    ar.loaded.params,
    batch,
    None,
    model=ar.loaded.model,
    config=config,
    estimator="exact",
    t_sampling="uniform",
  )
  np.testing.assert_allclose([-ll for ll, _ in results], exact, rtol=1e-5)
  assert all(r["stderr"] == 0 and r["likelihood"] == "exact" for r in ar.records)
  # Greedy decoding's continuation is greedy; one token changed is not.
  greedy_kwargs = {"max_gen_toks": 5, "do_sample": False}
  (generated,) = ar.generate_until([request("generate_until", "1 2", greedy_kwargs)])
  ids = generated.split()
  changed = " " + " ".join([*ids[:2], str((int(ids[2]) + 1) % VOCAB), *ids[3:]])
  assert len(ids) == 5
  checks = ar.loglikelihood(
    [request("loglikelihood", "1 2", generated), request("loglikelihood", "1 2", changed)]
  )
  assert [greedy for _, greedy in checks] == [True, False]
  with pytest.raises(harness.HarnessError, match="an ar model's NLL is exact"):
    harness.Md4jaxLM(workdir=str(tmp_path), likelihood="order")


@pytest.mark.slow
def test_a_block_diffusion_workdir_scores_and_samples_block_by_block(language, tmp_path):
  config = config_lib.load_config("tiny")
  config.diffusion.block_size, config.model.time_conditioning = 4, "none"
  blocks = harness.Md4jaxLM(workdir=saved_init(config, tmp_path), draws=2, batch_size=8)
  rows = sequences(language, 2, 10, seed=11)
  results = blocks.loglikelihood(pairs(rows, 5))
  # md4jax's block NELBO (objective.sequence_nats of the block config) of the same padded rows
  # and the same draws: the rows' keys from their row_ids, whatever the batch.
  tokens = np.zeros((2, SEQ_LEN), np.int32)
  tokens[:, :10] = rows
  editable = np.broadcast_to((np.arange(SEQ_LEN) >= 5) & (np.arange(SEQ_LEN) < 10), tokens.shape)
  batch = harness_model.batch_of(tokens, editable, np.full(2, 10))
  row_index = jnp.asarray([harness_model.row_id(r, e[:10]) for r, e in zip(rows, editable)])
  key = rng.stream(0, harness_model.KEY_STREAM)
  draws = md4jax_draws(blocks, batch, [jax.random.fold_in(key, k) for k in range(2)], row_index)
  assert blocks.loaded.model.block_size == 4 and draws.std(0).min() > 0  # Two different draws.
  np.testing.assert_allclose([-ll for ll, _ in results], draws.mean(0), rtol=1e-5, atol=1e-5)
  (generated,) = blocks.generate_until([request("generate_until", "1 2 3", {"max_gen_toks": 7})])
  assert len(generated.split()) == 7
  guided = harness.Md4jaxLM(
    loaded=blocks.loaded,
    **{"config.sample.guidance_scale": 1.0, "config.sample.prompt": "1"},  # A prompt: validation.
    batch_size=8,
  )
  assert len(guided.generate_until([request("generate_until", "1 2", {"max_gen_toks": 3})])) == 1
  with pytest.raises(harness.HarnessError, match="an empty context") as raised:
    guided.generate_until([request("generate_until", "", {"max_gen_toks": 3})])
  assert "\n" not in str(raised.value)


def test_text_pairs_split_at_word_boundaries_and_generation_ends_at_eos(lm):
  # A byte tokenizer with EOS (id 256): what a text workdir's tokenizer.json gives.
  config = lm.config.copy_and_resolve_references()
  config.data.vocab_size = 257
  codec = tokenizer_lib.ByteTokenizer(eos=True)
  loaded = harness_model.Loaded(config, lm.loaded.model, lm.loaded.params, codec, lm.loaded.mesh)
  text_lm = harness.Md4jaxLM(loaded=loaded)
  context, continuation = text_lm._pair("The cat ", "sat")  # pylint: disable=protected-access
  assert bytes(context) == b"The cat" and bytes(continuation) == b" sat"
  generated = np.asarray([*b" on the mat", 256, *b"garbage"])
  assert text_lm._text_after(context, generated) == " on the mat"  # pylint: disable=protected-access
  # The context keeps at least half the window when the generation would not leave it room.
  long = list(range(100))
  assert text_lm.generation_window(long, 256) == (long[-8:], 8)
  assert text_lm.generation_window(long[:3], 5) == (long[:3], 5)
  assert text_lm.generation_window(long[:12], 2) == (long[:12], 2)


def test_bad_model_args_are_one_line_errors(workdir, tmp_path):
  cases = {
    "no config.json there \\(the folder does not exist\\)": dict(workdir=str(tmp_path / "missing")),
    "no config.json there; name a workdir md4jax trained": dict(workdir=str(tmp_path)),
    "unknown model_arg drawz": dict(workdir=str(workdir), drawz=3),
    "eval.likelihood must be": dict(workdir=str(workdir), likelihood="orders:x"),
    "no key 'nosuch'": {"workdir": str(workdir), "config.sample.nosuch": 1},
    "rolling_context=16": dict(workdir=str(workdir), rolling_context=16),
    "max_gen_toks='many'": dict(workdir=str(workdir), max_gen_toks="many"),
    "sample.cache": {"workdir": str(workdir), "config.sample.cache": "prefix"},
  }
  (tmp_path / "untrained" / "checkpoints").mkdir(parents=True)
  shutil.copy(workdir / "config.json", tmp_path / "untrained")
  cases[r"workdir='.*untrained': no checkpoint in .*untrained/checkpoints\.$"] = dict(
    workdir=str(tmp_path / "untrained")
  )
  for message, args in cases.items():
    with pytest.raises(harness.HarnessError, match=message) as raised:
      harness.Md4jaxLM(**args)
    assert "\n" not in str(raised.value)


def write_tasks(folder, language) -> dict:
  return harness_tasks.write_tasks(
    folder, language, SEQ_LEN, num_questions=8, num_texts=4, num_prompts=4, seed=9
  )


def evaluate(model, folder) -> dict:
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top

  return lm_eval.simple_evaluate(
    model=model,
    tasks=list(harness_tasks.TASKS),
    task_manager=TaskManager(include_path=str(folder)),
    log_samples=True,
  )


@pytest.mark.slow
def test_local_yaml_tasks_through_simple_evaluate(workdir, language, tmp_path):
  exact = write_tasks(tmp_path, language)
  se_path = tmp_path / "se.jsonl"
  model = harness.Md4jaxLM(workdir=str(workdir), draws=4, se_path=str(se_path), batch_size=8)
  out = evaluate(model, tmp_path)
  choice, rolling, gen = (out["results"][task] for task in harness_tasks.TASKS)
  assert 0 <= choice["acc,none"] <= 1
  # A bound of a 20-step model: above the true chain's perplexity, below 8 per token squared.
  assert exact[harness_tasks.TASKS[1]]["word_perplexity"] < rolling["word_perplexity,none"] < 64
  generations = [s["resps"][0][0] for s in out["samples"][harness_tasks.TASKS[2]]]
  assert len(generations) == 4 and all(
    g.startswith(" ") and len(g.split()) == 1 for g in generations
  )
  lines = [json.loads(line) for line in se_path.read_text().splitlines()]
  assert len(lines) == 8 * 2 + 4 == len(model.records)  # Two choices a question, four texts.
  # lm-eval's logged responses are the harness's records, request for request.
  scored = {(r["context"], r["continuation"]): r["loglikelihood"] for r in lines if "context" in r}
  pairs = [
    (tuple(arguments), response[0][0])
    for sample in out["samples"][harness_tasks.TASKS[0]]
    for arguments, response in zip(sample["arguments"], sample["resps"])
  ]
  assert len(pairs) == 16 and all(scored[args] == value for args, value in pairs)


@pytest.mark.slow
def test_exact_oracle_through_lm_eval_gives_the_true_chain_figures(oracle, language, tmp_path):
  # Left to right, the exact denoiser is the true chain: lm-eval's acc, rolling perplexity and
  # greedy next id are the truth's on the same documents (a window's context holds the last id).
  exact = write_tasks(tmp_path, language)
  out = evaluate(harness.Md4jaxLM(loaded=oracle, likelihood="order", batch_size=8), tmp_path)
  choice, rolling, gen = (out["results"][task] for task in harness_tasks.TASKS)
  assert choice["acc,none"] == exact[harness_tasks.TASKS[0]]["acc"]
  assert gen["exact_match,none"] == 1.0  # Greedy after the context: the transition's mode.
  assert rolling["word_perplexity,none"] == pytest.approx(
    exact[harness_tasks.TASKS[1]]["word_perplexity"], rel=1e-4
  )


def lm_eval_command(model_args: str, folder, tasks: str) -> subprocess.CompletedProcess:
  """python -m md4jax.lm_eval on the tasks in folder, offline."""
  command = f"--model md4jax --model_args {model_args} --tasks {tasks} --include_path {folder}"
  return subprocess.run(
    [sys.executable, "-m", "md4jax.lm_eval", *command.split(), "--batch_size", "8"],
    capture_output=True,
    text=True,
    env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
  )


@pytest.mark.slow  # Two starts of lm-eval's command line: 15-25 s each on 2 shared cores.
def test_command_line_runs_the_local_tasks_and_errors_in_one_line(workdir, language, tmp_path):
  write_tasks(tmp_path, language)
  model_args = f"workdir={workdir},draws=4,se_path={tmp_path / 'se.jsonl'}"
  result = lm_eval_command(model_args, tmp_path, ",".join(harness_tasks.TASKS))
  assert result.returncode == 0, result.stderr[-2000:]
  assert all(name in result.stdout for name in harness_tasks.TASKS)
  assert len((tmp_path / "se.jsonl").read_text().splitlines()) == 20
  result = lm_eval_command(f"workdir={tmp_path / 'missing'}", tmp_path, harness_tasks.TASKS[0])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
    f"md4jax: error: workdir='{tmp_path / 'missing'}': no config.json there (the folder does not "
    "exist); name a workdir md4jax trained or converted (python -m md4jax.convert)."
  )
