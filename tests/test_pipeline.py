"""Tests for md4jax.data.pipeline: packing, determinism, sharding, resume, evaluation, load_data, conditional data."""

import itertools
import json
import pathlib
import pickle

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags

from md4jax.data import documents, pipeline
from md4jax.data import sources as data_lib
from md4jax.data.pipeline import EvalBatches, TokenizedDocs, TrainIterator
from md4jax.data.tokenizer import BpeTokenizer
from md4jax.diffusion import bounds

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
KEYS = ("editable", "positions", "segment_ids", "tokens")


def _stream(n):
  """One document whose token values are their positions in the stream."""
  return TokenizedDocs(np.arange(n, dtype=np.int32), np.array([0, n]))


def _docs(lengths):
  """Documents whose tokens encode (document, position): 1000 * (d + 1) + i."""
  docs = [1000 * (d + 1) + np.arange(n) for d, n in enumerate(lengths)]
  return TokenizedDocs(np.concatenate(docs).astype(np.int32), np.cumsum([0, *lengths]))


_LENGTHS = np.random.default_rng(0).integers(1, 40, size=60).tolist()


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _iterator(docs, packing, seed=0, shard_index=0, shard_count=1, batch_size=4, seq_len=16):
  ds = pipeline.train_dataset(
    docs,
    seq_len=seq_len,
    batch_size=batch_size,
    seed=seed,
    packing=packing,
    shard_index=shard_index,
    shard_count=shard_count,
  )
  return TrainIterator(ds)


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == list(KEYS)
    for k in KEYS:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_batches_shape_and_dtype(packing):
  batch = next(_iterator(_docs(_LENGTHS), packing))
  # "concat" rows are each one whole segment: no segment ids (the model builds no mask).
  whole = packing == "concat"
  assert sorted(batch) == list(KEYS)
  for k in KEYS:
    if whole and k in ("segment_ids", "positions"):
      assert batch[k] is None
    else:
      assert batch[k].shape == (4, 16) and batch[k].dtype == (bool if k == "editable" else np.int32)
  # Plain text: everything but padding is editable.
  np.testing.assert_array_equal(batch["editable"], True if whole else batch["segment_ids"] > 0)
  # data.has_segments, from which aot builds the train step's abstract batch, says the same.
  config = ml_collections.ConfigDict({"data": {"dataset": "localtext", "packing": packing}})
  assert data_lib.has_segments(config, training=True) == (not whole)
  assert data_lib.has_segments(config, training=False)
  assert all(
    b["segment_ids"] is not None
    for b in EvalBatches(_docs(_LENGTHS), seq_len=16, batch_size=4, packing=packing)
  )


def test_concat_windows_are_contiguous_at_random_offsets():
  batches = _take(_iterator(_stream(1000), "concat"), 10)
  tokens = np.concatenate([b["tokens"] for b in batches])
  starts = tokens[:, 0]
  np.testing.assert_array_equal(tokens, starts[:, None] + np.arange(16))
  assert all(b["segment_ids"] is None and b["positions"] is None for b in batches)
  assert all(b["editable"].all() for b in batches)
  assert len(set((starts % 16).tolist())) > 5  # Offsets are not the fixed window grid.


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_deterministic_by_seed(packing):
  docs = _docs(_LENGTHS)
  run = lambda seed: _take(_iterator(docs, packing, seed=seed), 6)
  _assert_batches_equal(run(3), run(3))
  assert any((a["tokens"] != b["tokens"]).any() for a, b in zip(run(3), run(4)))


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_two_processes_see_disjoint_shards_of_the_global_batch(packing):
  docs = _docs(_LENGTHS)
  first_tokens = lambda batches: [row[0] for b in batches for row in b["tokens"]]
  shards = [
    first_tokens(_take(_iterator(docs, packing, shard_index=p, shard_count=2), 3)) for p in (0, 1)
  ]
  # Rows start with distinct tokens (each token value occurs once in `docs`).
  assert not set(shards[0]) & set(shards[1])
  # Process p holds the p-th block of each single-process batch of twice the size, so the
  # global batch is the same rows in the same order on any number of processes.
  single = _take(_iterator(docs, packing, batch_size=8), 3)
  halves = [_take(_iterator(docs, packing, shard_index=p, shard_count=2), 3) for p in (0, 1)]
  for i, batch in enumerate(single):
    for key in KEYS:
      parts = [halves[0][i][key], halves[1][i][key]]
      if batch[key] is None:  # "concat": no segment ids on either process.
        assert parts == [None, None], key
      else:
        np.testing.assert_array_equal(np.concatenate(parts), batch[key])


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_resume_gives_the_uninterrupted_batches(packing):
  docs = _docs(_LENGTHS)
  uninterrupted = _take(_iterator(docs, packing, seed=7), 8)
  first = _iterator(docs, packing, seed=7)
  _take(first, 5)
  state = json.loads(json.dumps(first.get_state()))  # As a checkpoint would store it.
  assert state == {"next_batch_index": 5}
  resumed = _iterator(docs, packing, seed=7)
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 3), uninterrupted[5:])
  # Restoring a state mid-run rewinds too.
  first.set_state({"next_batch_index": 2})
  _assert_batches_equal(_take(first, 2), uninterrupted[2:4])


def test_resume_with_a_worker_process():
  flags.FLAGS.mark_as_parsed()  # grain workers read absl flags.
  docs = _docs(_LENGTHS)
  ds = pipeline.train_dataset(
    docs, seq_len=16, batch_size=4, seed=1, packing="documents", shard_index=0, shard_count=1
  )
  uninterrupted = _take(TrainIterator(ds), 5)
  with_worker = TrainIterator(ds, worker_count=1)
  with_worker.set_state({"next_batch_index": 2})
  try:
    _assert_batches_equal(_take(with_worker, 3), uninterrupted[2:])
  finally:
    with_worker.close()


def test_document_packing_keeps_documents_whole():
  lengths = _LENGTHS + [16, 40]  # An exact fit and one longer than a row.
  docs = _docs(lengths)
  rows = list(
    itertools.chain.from_iterable(
      zip(*[b[k] for k in KEYS])
      for b in EvalBatches(docs, seq_len=16, batch_size=4, packing="documents")
    )
  )
  pieces = []
  for editable, positions, segments, tokens in rows:
    np.testing.assert_array_equal(editable, segments > 0)
    n = int((segments > 0).sum())
    assert (segments[n:] == 0).all() and (tokens[n:] == 0).all()  # Padding at the end.
    if not n:
      continue  # An all-padding row filling the last batch.
    assert (np.diff(segments[:n]) >= 0).all() and segments[0] == 1
    for s in range(1, segments.max() + 1):
      piece = tokens[segments == s]
      np.testing.assert_array_equal(positions[segments == s], np.arange(len(piece)))
      doc, within = piece // 1000 - 1, piece % 1000
      assert (doc == doc[0]).all(), "a segment mixes documents"
      np.testing.assert_array_equal(within, within[0] + np.arange(len(piece)))
      # Only documents longer than a row are cut, at multiples of the row length.
      assert within[0] % 16 == 0 and (within[0] == 0 or lengths[doc[0]] > 16)
      if lengths[doc[0]] <= 16:
        assert len(piece) == lengths[doc[0]]
      pieces.append(piece)
  # Every token exactly once (full pieces of long documents are rows of their own,
  # so they can come before the tail of an earlier document).
  np.testing.assert_array_equal(np.sort(np.concatenate(pieces)), docs.tokens)


def test_an_epoch_of_packed_rows_visits_every_row_once():
  docs = _docs(_LENGTHS)
  num_rows = len(pipeline.pack_documents(docs.offsets, 16)[0]) - 1
  batches = _take(_iterator(docs, "documents", batch_size=1), num_rows)
  firsts = [b["tokens"][0, 0] for b in batches]
  assert len(set(firsts)) == num_rows
  assert firsts != sorted(firsts)  # Shuffled.


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
@pytest.mark.parametrize("shard_count", [1, 2, 3])
def test_eval_scores_every_token_exactly_once(packing, shard_count):
  docs = _docs(_LENGTHS) if packing == "documents" else _stream(1003)
  shards = [
    EvalBatches(
      docs, seq_len=16, batch_size=4, packing=packing, shard_index=p, shard_count=shard_count
    )
    for p in range(shard_count)
  ]
  assert len({len(s) for s in shards}) == 1  # Every process runs the same number of steps.
  scored = []
  for shard in shards:
    batches = list(shard)
    assert len(batches) == len(shard)
    for b in batches:
      assert all(b[k].shape == (4, 16) for k in KEYS)
      assert (b["tokens"][b["segment_ids"] == 0] == 0).all()
      np.testing.assert_array_equal(b["editable"], b["segment_ids"] > 0)
      scored.append(b["tokens"][b["segment_ids"] > 0])
  np.testing.assert_array_equal(np.sort(np.concatenate(scored)), np.sort(docs.tokens))
  # The global evaluation batches (each process's block side by side) do not depend on the count.
  whole = list(EvalBatches(docs, seq_len=16, batch_size=4 * shard_count, packing=packing))
  for i, batch in enumerate(whole):
    np.testing.assert_array_equal(
      np.concatenate([list(s)[i]["tokens"] for s in shards]), batch["tokens"]
    )
  assert list(shards[0]) and all(
    (x["tokens"] == y["tokens"]).all() for x, y in zip(shards[0], shards[0])
  )  # Re-iterable.


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(packing="greedy"), "Unknown packing"),
    (dict(seed=-1), "seed must be in"),
    (dict(shard_index=2, shard_count=2), "shard_index=2"),
    (dict(seq_len=2000), "fewer than seq_len"),
  ],
)
def test_train_dataset_errors(kwargs, match):
  args = dict(seq_len=16, batch_size=2, seed=0, packing="concat", shard_index=0, shard_count=1)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    pipeline.train_dataset(_stream(1000), **args)


def _config(dataset, path, **data):
  config = ml_collections.ConfigDict()
  config.data = ml_collections.ConfigDict(
    dict(
      dataset=dataset,
      path=str(path),
      seq_len=32,
      tokenizer="bpe",
      tokenizer_path="",
      bpe_vocab_size=300,
      packing="documents",
      text_field="text",
      prompt_field="prompt",
      response_field="response",
      worker_count=0,
    )
  )
  config.data.update(data)
  return config


_WORDS = "the a cat dog sat ran on under mat tree big small red blue . ,".split()


def _write_jsonl(path, n, seed=0, words=(5, 60)):
  rng = np.random.default_rng(seed)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(
    "\n".join(
      json.dumps({"text": " ".join(rng.choice(_WORDS, rng.integers(*words)))}) for _ in range(n)
    )
  )


def test_load_data_localtext_bpe_and_cache_reuse(tmp_path):
  _write_jsonl(tmp_path / "corpus" / "docs.jsonl", 60)
  workdir = tmp_path / "work"
  data = pipeline.load_data(_config("localtext", tmp_path / "corpus"), str(workdir))
  assert (workdir / "tokenizer.json").is_file() and data.tokenizer.eos_id is not None
  assert data.train.num_docs == 57 and data.validation.num_docs == 3
  batch = next(data.train_iterator(batch_size=2, seed=0, shard_index=0, shard_count=1))
  assert batch["tokens"].shape == (2, 32) and batch["tokens"].max() < data.tokenizer.vocab_size
  text = data.tokenizer.decode(batch["tokens"][0][batch["segment_ids"][0] == 1])
  assert set(text.split()) <= set(_WORDS)
  # Resume: the same tokenizer and the cached tokens (memory-mapped, pickled by path).
  again = pipeline.load_data(_config("localtext", tmp_path / "corpus"), str(workdir))
  assert again.train.path and len(pickle.dumps(again.train)) < 1000
  np.testing.assert_array_equal(
    np.asarray(pickle.loads(pickle.dumps(again.train)).tokens), data.train.tokens
  )
  _assert_batches_equal(
    [next(again.train_iterator(batch_size=2, seed=0, shard_index=0, shard_count=1))], [batch]
  )
  assert len(again.eval_batches(batch_size=2, shard_index=0, shard_count=1)) >= 1
  with pytest.raises(ValueError, match="No 'test' split"):
    again.eval_batches(batch_size=2, split="test")


@pytest.mark.parametrize(
  "dataset, seq_len, layout", [("lm1b", 128, ("train", "test")), ("owt", 1024, ("",))]
)
def test_lm1b_and_owt_from_local_stand_ins(tmp_path, dataset, seq_len, layout):
  # A tiny BPE stands in for BERT-base-uncased / GPT-2 (used offline as a tokenizer.json).
  stand_in = BpeTokenizer.train([" ".join(_WORDS)] * 10, 280)
  stand_in.save(tmp_path / "tok")
  for i, split in enumerate(layout):
    _write_jsonl(
      tmp_path / "corpus" / split / "part.jsonl", 40 if i == 0 else 5, seed=i, words=(5, 400)
    )
  config = _config(
    dataset,
    tmp_path / "corpus",
    seq_len=seq_len,
    packing="concat",
    tokenizer_path=str(tmp_path / "tok" / "tokenizer.json"),
  )
  data = pipeline.load_data(config, str(tmp_path / "work"))
  assert data.tokenizer.vocab_size == 280
  batch = next(data.train_iterator(batch_size=2, seed=0, shard_index=0, shard_count=1))
  assert batch["tokens"].shape == (2, seq_len) and batch["segment_ids"] is None
  assert not data_lib.has_segments(config, training=True) and data_lib.has_segments(
    config, training=False
  )
  assert (batch["tokens"] == data.tokenizer.eos_id).any()  # Documents are separated by EOS.
  ev = list(data.eval_batches(batch_size=2, shard_index=0, shard_count=1))
  assert sum(int((b["segment_ids"] > 0).sum()) for b in ev) == data.validation.num_tokens


def test_load_data_text8_shared_file(tmp_path):
  path = SHARED / "wiki_text8_dev.txt"
  if not path.is_file():
    pytest.skip(f"{path} is absent (no shared/ folder beside this checkout)")
  config = _config("text8", path, seq_len=256, packing="concat")
  data = pipeline.load_data(config, str(tmp_path))
  assert data.tokenizer.vocab_size == 27 and data.test is not None
  batch = next(data.train_iterator(batch_size=4, seed=0, shard_index=0, shard_count=1))
  assert batch["tokens"].shape == (4, 256) and batch["tokens"].max() < 27
  assert " the " in " ".join(data.tokenizer.decode(row) for row in batch["tokens"])
  ev = data.eval_batches(batch_size=64, split="test", shard_index=0, shard_count=1)
  assert sum(int((b["segment_ids"] > 0).sum()) for b in ev) == data.test.num_tokens


# ---------------------------------------------------------------- conditional data


def _write_pairs(path, pairs):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(json.dumps({"prompt": p, "response": r}) for p, r in pairs) + "\n")


def _random_pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  return [
    (
      "q" + "".join(rng.choice(list("xyz"), rng.integers(0, 6))),
      "".join(rng.choice(list("abcd"), rng.integers(1, 14))),
    )
    for _ in range(n)
  ]


def _rows(batches):
  """(tokens, segment_ids, positions, editable) of every non-padding row."""
  return [
    row
    for b in batches
    for row in zip(b["tokens"], b["segment_ids"], b["positions"], b["editable"])
    if row[1].any()
  ]


def test_conditional_rows_put_the_prompt_then_the_response(tmp_path):
  pairs = [("xy", "abc"), ("", "d"), ("zzzz", "abcdabcdabcdabcd")]  # The last is cut.
  _write_pairs(tmp_path / "data" / "train" / "a.jsonl", _random_pairs(20))
  _write_pairs(tmp_path / "data" / "validation" / "b.jsonl", pairs)
  config = _config("conditional", tmp_path / "data", seq_len=12, tokenizer="char")
  with pytest.warns(UserWarning, match="1 of 3 conditional responses were cut"):
    data = pipeline.load_data(config, str(tmp_path / "work"))
  tok = data.tokenizer
  assert data.validation.num_truncated == 1
  rows = _rows(data.eval_batches(batch_size=2, shard_index=0, shard_count=1))
  assert len(rows) == len(pairs)  # One example per row.
  for (prompt, response), (tokens, segments, positions, editable) in zip(pairs, rows):
    p = len(tok.encode(prompt))
    expected = np.concatenate([tok.encode(prompt), tok.encode(response), [tok.eos_id]])[:12]
    n = len(expected)
    np.testing.assert_array_equal(tokens[:n], expected)
    assert (tokens[n:] == 0).all() and (segments[n:] == 0).all()
    # Prompt and response are one segment: the denoiser reads the prompt.
    assert (segments[:n] == 1).all()
    np.testing.assert_array_equal(positions[:n], np.arange(n))
    # Editable exactly on the response and its EOS: never the prompt nor padding.
    np.testing.assert_array_equal(editable, (np.arange(12) >= p) & (np.arange(12) < n))
  # Training rows: shuffled whole examples, same layout; a resumed run reuses the cache.
  again = pipeline.load_data(config, str(tmp_path / "work"))
  np.testing.assert_array_equal(again.train.prompt_lengths, data.train.prompt_lengths)
  batch = next(again.train_iterator(batch_size=4, seed=0, shard_index=0, shard_count=1))
  for tokens, segments, _, editable in _rows([batch]):
    first = np.argmax(editable)
    assert editable[first:].sum() == (segments[first:] > 0).sum() > 0
    assert not editable[:first].any() and tokens[0] == tok.encode("q")[0]


def test_conditional_nelbo_never_masks_the_prompt(tmp_path):
  _write_pairs(tmp_path / "pairs.jsonl", _random_pairs(40))
  data = pipeline.load_data(
    _config("conditional", tmp_path / "pairs.jsonl", seq_len=16, tokenizer="char"),
    str(tmp_path / "work"),
  )
  batch = next(data.train_iterator(batch_size=8, seed=0, shard_index=0, shard_count=1))
  x, editable = jnp.asarray(batch["tokens"]), jnp.asarray(batch["editable"])
  mask_id, seen = data.tokenizer.vocab_size, []

  def spy(z_t, alpha_t):
    del alpha_t
    seen.append(np.asarray(z_t))
    return jnp.zeros(z_t.shape + (mask_id,))

  for estimator in bounds.ESTIMATORS:
    for seed in range(5):
      bounds.nelbo(
        jax.random.PRNGKey(seed),
        spy,
        x,
        "linear",
        mask_id=mask_id,
        editable=editable,
        estimator=estimator,
      )
  prompt = ~batch["editable"]
  assert seen and all((z[prompt] == batch["tokens"][prompt]).all() for z in seen)
  assert any((z[batch["editable"]] == mask_id).any() for z in seen)  # Responses are masked.
  # Scored tokens are the response tokens only.
  np.testing.assert_array_equal(bounds.num_valid_tokens(x, editable), batch["editable"].sum(-1))


def test_conditional_prompt_longer_than_a_row_names_the_example(tmp_path):
  pairs = _random_pairs(5)
  pairs[2] = ("x" * 16, "abc")
  _write_pairs(tmp_path / "pairs.jsonl", pairs)
  config = _config("conditional", tmp_path / "pairs.jsonl", seq_len=16, tokenizer="char")
  with pytest.raises(ValueError, match=r"pairs.jsonl:3: the prompt is 16 tokens.*data.seq_len=16"):
    pipeline.load_data(config, str(tmp_path / "work"))
  assert not list((tmp_path / "work" / "data_cache").iterdir())  # No half-written cache.


def test_conditional_examples_need_document_rows():
  docs = pipeline.tokenize_examples(
    [documents.Example("x", "ab", "f:1")] * 3,
    pipeline.tokenizer_lib.CharTokenizer("abx", eos=True),
    seq_len=8,
  )
  with pytest.raises(ValueError, match="one row each"):
    pipeline.train_dataset(docs, seq_len=8, batch_size=1, seed=0, packing="concat")
