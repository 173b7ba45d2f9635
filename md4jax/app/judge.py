"""The AR judge of config.eval.judge_workdir: loaded from its workdir (`md4jax.load`), and the
fresh samples it scores (generative perplexity beside sample entropy)."""

import ml_collections

from md4jax import rng
from md4jax.app import generate, load
from md4jax.evaluation.evaluate import Judge


def from_workdir(judge_workdir, mesh) -> Judge:
  """The judge of one of our AR workdirs (its newest checkpoint's EMA params), on mesh."""
  loaded = load.load(judge_workdir, mesh=mesh, role="eval.judge_workdir", check_config=False)
  if loaded.config.model.type != "ar":
    raise ValueError(
      f"The judge in {judge_workdir} is model.type={loaded.config.model.type!r}; "
      "generative perplexity needs an exact likelihood, an 'ar' model."
    )
  return Judge(loaded.config, loaded.model, loaded.params, mesh, workdir=str(judge_workdir))


def judge_samples(config: ml_collections.ConfigDict, model, params, source, judge: Judge) -> dict:
  """Fresh samples of the evaluated model (after any prompt), scored by the AR judge."""
  run = generate.settings(config)
  judge.check_compatible(config, run["length"])
  key = rng.stream(config.seed, "judged_samples")
  judged = config.copy_and_resolve_references()
  judged.sample.num_samples = config.eval.num_judged_samples
  tokens, nfe, _, _ = generate.generate(judged, model, params, source, key)
  prompt_length = len(generate.encode_prompt(config, source))
  return {
    **judge.score(tokens, prompt_length),
    "judge_workdir": judge.workdir,
    "num_judged_samples": int(len(tokens)),
    "sampler": {**run, "nfe": nfe},
  }
