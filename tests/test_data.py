"""The Markov source: batch i is one exact draw of the chain, however batches are fetched."""

import jax
import numpy as np

from md4jax import config as config_lib
from md4jax import rng
from md4jax.data import sources


def test_markov_batches_drawn_together_equal_one_draw_each():
  config = config_lib.load_config("tiny")
  source = sources.MarkovSource(config)
  # In order across a block boundary, then as a resumed run would ask for them.
  for index in (
    0,
    1,
    sources._BATCHES_PER_DRAW - 1,
    sources._BATCHES_PER_DRAW,
    3,
    2 * sources._BATCHES_PER_DRAW + 5,
  ):
    alone = source.language.sample(
      jax.random.fold_in(source._train_key, index), config.batch_size, config.data.seq_len
    )
    np.testing.assert_array_equal(
      source.batch(index)["tokens"], np.asarray(alone), err_msg=str(index)
    )


def test_each_process_takes_its_block_of_the_global_batch():
  config = config_lib.load_config("tiny")
  whole = sources.MarkovSource(config).batch(7)
  halves = [sources.MarkovSource(config, shard=(i, 2)).batch(7) for i in range(2)]
  for name, rows in whole.items():
    if rows is None:  # One whole segment per row: no segment ids, on every process.
      assert all(half[name] is None for half in halves), name
    else:
      np.testing.assert_array_equal(np.concatenate([half[name] for half in halves]), rows)


def test_evaluation_batches_pad_whole_rows_without_segment_ids():
  config = config_lib.load_config("tiny")
  batches = sources.MarkovSource(config).eval_batches(num_sequences=20, batch_size=16)
  assert [b["tokens"].shape for b in batches] == [(16, config.data.seq_len)] * 2
  assert all(b["segment_ids"] is None and b["positions"] is None for b in batches)
  # Padding is whole rows, never scored: no row reads another, so no mask is needed.
  np.testing.assert_array_equal(batches[1]["editable"].all(-1), [True] * 4 + [False] * 12)
  assert not batches[1]["editable"][4:].any() and (batches[1]["tokens"][4:] == 0).all()
  assert not sources.has_segments(config, training=True) and not sources.has_segments(
    config, training=False
  )


def test_rng_streams_keep_their_numbers():
  # A stream's number is part of what every seed gives (data, evaluation, samples): fixed.
  assert rng.STREAMS == {
    "train_data": 1,
    "eval_data": 2,
    "eval": 3,
    "sample": 4,
    "judged_samples": 5,
    "frontier": 6,
    "lm_eval": 7,
    "post_train": 8,
    "distill": 9,
  }
  for name, number in rng.STREAMS.items():
    expected = jax.random.fold_in(jax.random.PRNGKey(11), number)
    np.testing.assert_array_equal(rng.stream(11, name), expected)


def test_both_sources_have_every_member_of_the_protocol():
  members = set(sources.Source.__annotations__) | {
    name for name in vars(sources.Source) if not name.startswith("_")
  }
  assert {"text_lengths", "eval_batches", "true_bits_per_token"} <= members
  for cls in (sources.MarkovSource, sources.TextSource):
    assert not {name for name in members if not hasattr(cls, name)}, cls
