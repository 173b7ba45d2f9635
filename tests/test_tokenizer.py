"""Tests for md4jax.data.tokenizer: round trips, save/load, resume, errors."""

import numpy as np
import pytest

from md4jax.data import tokenizer as tokenizer_lib
from md4jax.data.tokenizer import BpeTokenizer, ByteTokenizer, CharTokenizer

_WORDS = (
  "the cat sat on a mat while dogs ran far away under big blue skies and "
  "seven quiet rivers flowed into the sea Überall café naïve"
).split()


def _documents(n=200, seed=0):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(_WORDS, size=rng.integers(3, 30))) for _ in range(n)]


def test_text8_vocabulary():
  tok = CharTokenizer.text8()
  assert tok.vocab_size == 27 and tok.eos_id is None
  np.testing.assert_array_equal(tok.encode("az "), [0, 25, 26])
  text = "anarchism originated as a term of abuse"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 27
  assert tok.decode(ids) == text


def test_char_rejects_unknown_characters_saying_which_and_where():
  with pytest.raises(ValueError, match=r"\['!', 'W'\].*first at character 6"):
    CharTokenizer.text8().encode("hello World!")


def test_char_from_texts_round_trip_and_eos():
  docs = ["héllo wörld", "日本語 ok", "😀 emoji"]
  tok = CharTokenizer.from_texts(docs)
  assert tok.vocab_size == len(set("".join(docs))) + 1 and tok.eos_id == tok.vocab_size - 1
  for doc in docs:
    assert tok.decode(tok.encode(doc)) == doc
  # EOS has no text of its own: it reads as the line break between documents.
  ids = np.concatenate([tok.encode(docs[0]), [tok.eos_id], tok.encode(docs[1])])
  assert tok.decode(ids) == docs[0] + "\n" + docs[1]


def test_byte_round_trip_non_ascii():
  tok = ByteTokenizer()
  assert (tok.vocab_size, tok.eos_id) == (257, 256)
  assert (ByteTokenizer(eos=False).vocab_size, ByteTokenizer(eos=False).eos_id) == (256, None)
  text = "naïve café – 日本 😀"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode("utf-8")) and ids.max() < 256
  assert tok.decode(ids) == text
  assert tok.decode(ids[:-1]).endswith("\ufffd")  # A cut character decodes as U+FFFD.


def test_decode_rejects_out_of_range_ids():
  for tok in (CharTokenizer.text8(), ByteTokenizer()):
    with pytest.raises(ValueError, match="outside"):
      tok.decode([0, tok.vocab_size])  # The mask id has no text.


def test_bpe_trains_round_trips_and_saves(tmp_path):
  docs = _documents()
  tok = BpeTokenizer.train(docs, vocab_size=320)
  assert tok.vocab_size == 320 and tok.eos_id == 0
  ids = [tok.encode(d) for d in docs]
  assert all(tok.decode(i) == d for i, d in zip(ids, docs))
  # Merges were learned: fewer tokens than bytes.
  assert sum(map(len, ids)) < 0.5 * sum(len(d.encode()) for d in docs)
  np.testing.assert_array_equal(np.concatenate(tok.encode_batch(docs[:5])), np.concatenate(ids[:5]))
  path = tok.save(tmp_path)
  assert path.name == "tokenizer.json"
  loaded = tokenizer_lib.load(path)
  assert loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
  for d, i in zip(docs, ids):
    np.testing.assert_array_equal(loaded.encode(d), i)


@pytest.mark.parametrize(
  "tok",
  [
    CharTokenizer.text8(),
    CharTokenizer("xyz", eos=True),
    ByteTokenizer(),
    ByteTokenizer(eos=False),
  ],
  ids=["text8", "char_eos", "byte", "byte_noeos"],
)
def test_char_byte_save_load(tmp_path, tok):
  tok.save(tmp_path)
  loaded = tokenizer_lib.load(tmp_path)
  assert (type(loaded), loaded.vocab_size, loaded.eos_id) == (type(tok), tok.vocab_size, tok.eos_id)
  text = "xyzzy" if tok.vocab_size < 27 else "a text"
  np.testing.assert_array_equal(loaded.encode(text), tok.encode(text))


def test_make_tokenizer_reuses_the_saved_one_on_resume(tmp_path):
  docs = _documents()
  first = tokenizer_lib.make_tokenizer(
    "bpe", train_text_iter=docs, vocab_size=350, workdir=tmp_path
  )
  assert (tmp_path / "tokenizer.json").is_file()
  # On resume there is no training text (nor would new text change the tokenizer).
  resumed = tokenizer_lib.make_tokenizer(
    "bpe", train_text_iter=["zzz"], vocab_size=999, workdir=tmp_path
  )
  assert resumed.vocab_size == 350
  for d in docs[:20]:
    np.testing.assert_array_equal(resumed.encode(d), first.encode(d))
  with pytest.raises(ValueError, match="holds a 'bpe' tokenizer but 'char'"):
    tokenizer_lib.make_tokenizer("char", train_text_iter=docs, workdir=tmp_path)


def test_make_tokenizer_kinds(tmp_path):
  docs = _documents(20)
  char = tokenizer_lib.make_tokenizer("char", train_text_iter=docs, workdir=tmp_path / "c")
  assert tokenizer_lib.load(tmp_path / "c").vocab_size == char.vocab_size
  assert tokenizer_lib.make_tokenizer("text8").vocab_size == 27
  assert tokenizer_lib.make_tokenizer("byte").vocab_size == 257
  # A local tokenizer.json (as GPT-2's would be) is used as is and copied to the workdir.
  BpeTokenizer.train(docs, 300).save(tmp_path / "pretrained")
  tok = tokenizer_lib.make_tokenizer(
    "bpe", path=tmp_path / "pretrained" / "tokenizer.json", workdir=tmp_path / "w"
  )
  assert tok.vocab_size == 300 and (tmp_path / "w" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(kind="wordpiece"), ValueError, "Unknown tokenizer kind"),
    (dict(kind="bpe"), ValueError, "needs training text"),
    (dict(kind="bpe", train_text_iter=["a b"]), ValueError, "needs vocab_size"),
    (dict(kind="bpe", train_text_iter=["a b"], vocab_size=100), ValueError, "smaller than"),
    (dict(kind="bpe", path="/nonexistent/tokenizer.json"), FileNotFoundError, "No tokenizer"),
  ],
)
def test_make_tokenizer_errors(kwargs, error, match):
  kind = kwargs.pop("kind")
  with pytest.raises(error, match=match):
    tokenizer_lib.make_tokenizer(kind, **kwargs)


def test_byte_lengths_count_the_utf8_bytes_of_encoded_text():
  docs = _documents() + ["ünseen 😀 emoji and ß"]
  text = "\n".join(docs)
  tokenizers = [
    BpeTokenizer.train(docs, vocab_size=320),
    CharTokenizer.from_texts([text]),
    ByteTokenizer(),
  ]
  for tok in tokenizers:
    for doc in docs[:20] + docs[-1:]:
      assert tok.byte_lengths[tok.encode(doc)].sum() == len(doc.encode("utf-8")), (tok.kind, doc)
    assert tok.byte_lengths[tok.eos_id] == 1  # EOS reads as a line break.


def test_byte_lengths_are_unknown_for_wordpiece():
  from tokenizers import Tokenizer, decoders, models  # pylint: disable=g-import-not-at-top

  wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
  wordpiece.decoder = decoders.WordPiece()
  assert BpeTokenizer(wordpiece).byte_lengths is None
