"""Local lm-evaluation-harness tasks over the generated Markov language (data.dataset = "markov"),
so that the md4jax model runs offline with nothing downloaded, and the true chain's own figures
on the same documents to read its numbers against (docs/lm_eval.md).

`write_tasks` writes three YAML tasks and their JSONL files into a folder (lm-eval's
--include_path); a document is its token ids separated by spaces, the text `MarkovCodec` reads:

  md4jax_markov_choice   multiple_choice: a sequence's first half, then its own second half or
                         another sequence's (acc: the model prefers the true one)
  md4jax_markov_rolling  loglikelihood_rolling: sequences of one to three context windows
  md4jax_markov_gen      generate_until: continue a sequence's first half, cut at `until`
"""

import json
import math
import pathlib

import jax
import numpy as np

TASKS = ("md4jax_markov_choice", "md4jax_markov_rolling", "md4jax_markov_gen")


def _text(ids) -> str:
  return " ".join(str(int(t)) for t in ids)


def _yaml(name: str, data: pathlib.Path, body: str) -> str:
  return (
    f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    f"test_split: test\n{body}"
  )


def write_tasks(
  folder,
  language,
  seq_len: int,
  *,
  num_questions: int = 64,
  num_texts: int = 16,
  num_prompts: int = 16,
  seed: int = 0,
) -> dict:
  """Writes the TASKS into `folder` and returns the true chain's figures on their documents:
  {"md4jax_markov_choice": {"acc"}, "md4jax_markov_rolling": {"word_perplexity"}}.

  The choice task's exact acc picks the continuation of higher true likelihood; the rolling
  task's exact word perplexity is exp(−log p(texts) / their tokens) (one id is one word).
  """
  folder = pathlib.Path(folder).absolute()
  folder.mkdir(parents=True, exist_ok=True)
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  half = seq_len // 2
  own, other = (np.asarray(language.sample(k, num_questions, seq_len)) for k in keys[:2])
  lengths = [seq_len * (1 + i % 3) - 3 * (i % 2) for i in range(num_texts)]  # 1-3 windows.
  texts = np.asarray(language.sample(keys[2], num_texts, max(lengths)))
  prompts = np.asarray(language.sample(keys[3], num_prompts, seq_len))
  files = {
    "choice": [
      {"context": _text(a[:half]), "choices": [_text(a[half:]), _text(b[half:])], "label": 0}
      for a, b in zip(own, other)
    ],
    "rolling": [{"text": _text(row[:n])} for row, n in zip(texts, lengths)],
    "gen": [{"context": _text(row[:half]), "target": " " + _text(row[half:])} for row in prompts],
  }
  for name, records in files.items():
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  bodies = {
    "choice": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
    "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n",
    "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
    "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n",
    # until: the word 0 (an id starts with 0 only if it is 0); at most half a window of new ids.
    "gen": "output_type: generate_until\ndoc_to_text: '{{context}}'\n"
    f"doc_to_target: '{{{{target}}}}'\ngeneration_kwargs:\n  until: [' 0']\n"
    f"  max_gen_toks: {seq_len - half}\nmetric_list:\n  - metric: exact_match\n",
  }
  for task, name in zip(TASKS, bodies):
    (folder / f"{task}.yaml").write_text(_yaml(task, folder / f"{name}.jsonl", bodies[name]))

  def log_p(rows):
    return np.asarray(language.log_prob(np.asarray(rows)), np.float64)

  # The continuations' conditional log-likelihoods differ from their joint ones by log p(context),
  # the same for both choices.
  exact_acc = float(
    np.mean(log_p(own) > log_p(np.concatenate([own[:, :half], other[:, half:]], 1)))
  )
  nats = sum(-log_p(row[None, :n])[0] for row, n in zip(texts, lengths))
  return {
    TASKS[0]: {"acc": exact_acc},
    TASKS[1]: {"word_perplexity": math.exp(nats / sum(lengths))},
  }
