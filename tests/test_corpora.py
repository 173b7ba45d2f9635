"""Tests for md4jax.data.corpora: text8 splits and validation, local files, conditional pairs, LM1B/OWT stand-ins."""

import importlib.util
import json
import pathlib
import zipfile

import numpy as np
import pytest

from md4jax.data import corpora, documents

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def _text8_like(n, seed=0):
  ids = np.random.default_rng(seed).integers(0, 27, n)
  return "".join(corpora.TEXT8_ALPHABET[i] for i in ids)


def test_text8_split_by_position(tmp_path):
  text = _text8_like(1000)
  (tmp_path / "small").write_text(text + "\n")  # An editor's final line break is allowed.
  corpus = corpora.text8(tmp_path / "small")
  (train,), (validation,), (test,) = corpus.train, corpus.validation, corpus.test
  assert (len(train), len(validation), len(test)) == (900, 50, 50)
  assert train + validation + test == text


def test_text8_standard_split_of_the_full_corpus():
  sizes = [len(s) for s in corpora.text8_splits("a" * 100_000_000)]
  assert sizes == [90_000_000, 5_000_000, 5_000_000]


def test_text8_zip(tmp_path):
  text = _text8_like(500)
  with zipfile.ZipFile(tmp_path / "text8.zip", "w") as zf:
    zf.writestr("text8", text)
  assert corpora.read_text8(tmp_path / "text8.zip") == text


@pytest.mark.parametrize(
  "content, error, match",
  [
    ("hello World", ValueError, r"\['W'\], first at character 6"),
    ("tab\tseparated", ValueError, "not text8-format"),
    ("", ValueError, "empty"),
  ],
)
def test_text8_invalid(tmp_path, content, error, match):
  (tmp_path / "bad").write_text(content)
  with pytest.raises(error, match=match):
    corpora.text8(tmp_path / "bad")


def test_text8_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="is not a file"):
    corpora.text8(tmp_path / "nope")
  with pytest.raises(ValueError, match="needs config.data.path"):
    corpora.load_corpus("text8", "")


def test_shared_text8_dev_file():
  path = SHARED / "wiki_text8_dev.txt"
  if not path.is_file():
    pytest.skip(f"{path} is absent (no shared/ folder beside this checkout)")
  corpus = corpora.load_corpus("text8", str(path))
  (train,), (validation,), (test,) = corpus.train, corpus.validation, corpus.test
  assert set(train + validation + test) == set(corpora.TEXT8_ALPHABET)
  n = len(train) + len(validation) + len(test)
  assert len(train) == n * 9 // 10 and len(validation) == n * 19 // 20 - n * 9 // 10


def test_text_file_one_document_per_non_empty_line(tmp_path):
  lines = [f"Document {i}: naïve text." for i in range(40)]
  (tmp_path / "c.txt").write_text("\n\n".join(lines) + "\n  \n")
  corpus = corpora.load_corpus("localtext", str(tmp_path / "c.txt"))
  # The last 5% (at least one) of the documents validate.
  assert list(corpus.train) == lines[:38] and list(corpus.validation) == lines[38:]
  assert list(corpus.train) == lines[:38]  # Re-iterable.


def test_folder_of_text_and_jsonl_files(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "2.jsonl").write_text(
    "\n".join(json.dumps({"body": f"json {i}", "id": i}) for i in range(3))
  )
  (tmp_path / "a.txt").write_text("one\ntwo\n")
  (tmp_path / "c.txt").write_text("three\n")
  (tmp_path / "ignored.csv").write_text("x,y\n")
  corpus = corpora.local_corpus(tmp_path, text_field="body", validation_fraction=0.3)
  # Files in sorted order: a.txt, b/2.jsonl, c.txt.
  assert list(corpus.train) + list(corpus.validation) == [
    "one",
    "two",
    "json 0",
    "json 1",
    "json 2",
    "three",
  ]
  assert len(corpus.validation) == 2


def test_folder_with_explicit_splits(tmp_path):
  for split, docs in (("train", ["a", "b", "c"]), ("test", ["d"])):
    (tmp_path / split).mkdir()
    (tmp_path / split / "x.txt").write_text("\n".join(docs))
  corpus = corpora.lm1b(tmp_path)
  assert (list(corpus.train), list(corpus.validation)) == (["a", "b", "c"], ["d"])


def test_openwebtext_stand_in_holds_out_at_most_the_last_100k(tmp_path):
  docs = [{"text": f"web page {i}"} for i in range(100)]
  (tmp_path / "owt.jsonl").write_text("\n".join(map(json.dumps, docs)))
  corpus = corpora.load_corpus("owt", str(tmp_path))
  # A 100-document stand-in holds out 5% (the full 8M-document corpus: its last 100k).
  assert [d for d in corpus.validation] == [f"web page {i}" for i in range(95, 100)]
  corpus = corpora.openwebtext(tmp_path, num_validation=3)
  assert len(corpus.validation) == 3 and len(corpus.train) == 97


def test_documents_ranges_cross_files(tmp_path):
  for i in range(3):
    (tmp_path / f"{i}.txt").write_text("\n".join(f"{i}-{j}" for j in range(4)))
  docs = documents.Documents(documents.list_files(tmp_path))
  head, tail = docs.split(5)
  assert list(head) == ["0-0", "0-1", "0-2", "0-3", "1-0"]
  _, middle = head.split(3)
  assert list(middle) == ["0-3", "1-0"] and len(tail) == 7


@pytest.mark.parametrize(
  "content, match",
  [
    ('{"title": "x"}\n{"title": "y"}\n', r"x.jsonl:1: no string field 'text' \(has \['title'\]\)"),
    ('{"text": "x"}\nnot json\n', r"x.jsonl:2: not valid JSON"),
    ('{"text": "only one"}\n', "holds 1 document"),
  ],
)
def test_jsonl_errors(tmp_path, content, match):
  (tmp_path / "x.jsonl").write_text(content)
  with pytest.raises(ValueError, match=match):
    list(corpora.local_corpus(tmp_path / "x.jsonl").train)


def test_conditional_pairs_split_like_local_corpora(tmp_path):
  lines = [json.dumps({"q": f"prompt {i}", "a": f"response {i}", "id": i}) for i in range(40)]
  (tmp_path / "pairs.jsonl").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]))
  corpus = corpora.load_corpus(
    "conditional", str(tmp_path / "pairs.jsonl"), prompt_field="q", response_field="a"
  )
  train, validation = list(corpus.train), list(corpus.validation)
  assert len(train) == 38 and len(validation) == 2
  assert train[0] == documents.Example("prompt 0", "response 0", f"{tmp_path / 'pairs.jsonl'}:1")
  assert validation[-1].where.endswith("pairs.jsonl:41")  # Line numbers count blank lines.
  assert list(corpus.train.texts())[:4] == ["prompt 0", "response 0", "prompt 1", "response 1"]
  other = corpora.load_corpus(
    "conditional", str(tmp_path / "pairs.jsonl"), prompt_field="a", response_field="q"
  )
  assert other.key != corpus.key  # Caches tell the field choices apart.


@pytest.mark.parametrize(
  "name, content, match",
  [
    (
      "x.jsonl",
      '{"prompt": "p", "answer": "r"}\n{"prompt": "p", "response": "r"}\n',
      r"x.jsonl:1: no string field 'response' \(has \['answer', 'prompt'\]\); "
      r"set config.data.response_field",
    ),
    (
      "x.jsonl",
      '{"prompt": 3, "response": "r"}\n{"prompt": "p", "response": "r"}\n',
      r"x.jsonl:1: no string field 'prompt'",
    ),
    ("x.txt", "one\ntwo\n", r"x.txt: conditional data is JSONL"),
  ],
)
def test_conditional_errors(tmp_path, name, content, match):
  (tmp_path / name).write_text(content)
  with pytest.raises(ValueError, match=match):
    list(corpora.conditional(tmp_path / name).train)
  with pytest.raises(ValueError, match="needs config.data.path"):
    corpora.load_corpus("conditional", "")


def test_local_path_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    corpora.local_corpus(tmp_path / "missing.txt")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="holds no .txt/.jsonl files"):
    corpora.local_corpus(tmp_path / "empty")
  with pytest.raises(ValueError, match="Unknown dataset"):
    corpora.load_corpus("c4", "x")


@pytest.mark.skipif(
  importlib.util.find_spec("tensorflow") is not None,
  reason="TensorFlow is installed, so tfds would try to download LM1B",
)
def test_lm1b_without_local_path_names_the_tf_extra():
  corpus = corpora.load_corpus("lm1b", "")
  with pytest.raises(ImportError, match=r"md4jax\[tf\]"):
    next(iter(corpus.train))


@pytest.mark.skipif(
  importlib.util.find_spec("datasets") is not None,
  reason="`datasets` is installed, so OpenWebText would be downloaded",
)
def test_openwebtext_without_local_path_needs_datasets():
  with pytest.raises(ImportError, match="pip install datasets"):
    corpora.load_corpus("owt", "")
