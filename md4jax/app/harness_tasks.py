"""Local lm-evaluation-harness tasks over the generated Markov language (data.dataset = "markov"),
so that the md4jax model runs offline with nothing downloaded, and the true chain's own figures
on the same documents to read its numbers against (docs/lm_eval.md).

`write_tasks` writes three YAML tasks and their JSONL files into a folder (lm-eval's
--include_path); a document is its token ids separated by spaces, the text `MarkovCodec` reads:

  md4jax_markov_choice   multiple_choice: a sequence's first half, then its own second half or
                         that half reversed (acc: the model prefers the chain's direction)
  md4jax_markov_rolling  loglikelihood_rolling: sequences of one to three context windows
  md4jax_markov_gen      generate_until, greedy: one id after a sequence's first half
                         (exact_match: it is the chain's most likely next id)
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
  """Writes the TASKS into `folder` and returns the true chain's figures on their documents,
  {task: {metric: value}}.

  The choice task's exact acc picks the continuation of higher true likelihood (the first on a
  tie, as lm-eval does); the rolling task's exact word perplexity is exp(−log p(texts) / their
  tokens) (one id is one word); the generation's target is the chain's mode after the context,
  so the chain's own exact_match is 1.
  """
  folder = pathlib.Path(folder).absolute()
  folder.mkdir(parents=True, exist_ok=True)
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  half = seq_len // 2
  own = np.asarray(language.sample(keys[0], num_questions, seq_len))
  backwards = np.concatenate([own[:, :half], own[:, : half - 1 : -1]], axis=1)
  lengths = [seq_len * (1 + i % 3) - 3 * (i % 2) for i in range(num_texts)]  # 1-3 windows.
  texts = np.asarray(language.sample(keys[1], num_texts, max(lengths)))
  prompts = np.asarray(language.sample(keys[2], num_prompts, half))
  modes = np.argmax(np.asarray(language.transition)[prompts[:, -1]], axis=-1)
  files = {
    "choice": [
      {"context": _text(a[:half]), "choices": [_text(a[half:]), _text(b[half:])], "label": 0}
      for a, b in zip(own, backwards)
    ],
    "rolling": [{"text": _text(row[:n])} for row, n in zip(texts, lengths)],
    "gen": [{"context": _text(row), "target": f" {mode}"} for row, mode in zip(prompts, modes)],
  }
  for name, records in files.items():
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  bodies = {
    "choice": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
    "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n",
    "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
    "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n",
    # One id, greedy (do_sample false: temperature 0); until is lm-eval's usual line break.
    "gen": "output_type: generate_until\ndoc_to_text: '{{context}}'\n"
    "doc_to_target: '{{target}}'\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 1\n"
    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
  }
  for task, name in zip(TASKS, bodies):
    (folder / f"{task}.yaml").write_text(_yaml(task, folder / f"{name}.jsonl", bodies[name]))

  def log_p(rows):
    return np.asarray(language.log_prob(np.asarray(rows)), np.float64)

  # A continuation's conditional log-likelihood differs from the joint one by log p(context),
  # the same for both choices.
  nats = sum(-log_p(row[None, :n])[0] for row, n in zip(texts, lengths))
  return {
    TASKS[0]: {"acc": float(np.mean(log_p(own) >= log_p(backwards)))},
    TASKS[1]: {"word_perplexity": math.exp(nats / sum(lengths))},
    TASKS[2]: {"exact_match": 1.0},
  }
