"""Sample generation for the CLI: `md4jax.sample` with config.sample's settings, prompts, records,
trajectory pages.

`config.sample` chooses the method, steps, temperature, top-k/top-p, prompt and length; the
model how it is decoded (`decoding`): an ar model token by token with a KV cache, block
diffusion in its blocks, an mdm past its context in windows. Every record carries the text,
the number of network calls (NFE) and the seconds the sampler ran (compilation excluded).
"""

import pathlib
import time

import jax
import ml_collections
import numpy as np

from md4jax.data import chat
from md4jax.diffusion.denoiser import caches_keys_and_values
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.sampling import arguments, decoder, samplers
from md4jax.sampling import trajectory as trajectory_lib
from md4jax.training import objective


def _block_length(config: ml_collections.ConfigDict) -> int:
  """sample.block_length where it decides the blocks (0: it does not): with sample.cache,
  sample.blocks_after_prompt, or an mdm's windows past the context (0 there: data.seq_len // 2)."""
  cfg, seq_len = config.sample, config.data.seq_len
  if cfg.cache != "none" or cfg.blocks_after_prompt:
    return cfg.block_length
  block_diffusion = 0 < config.diffusion.block_size < seq_len
  if config.model.type == "mdm" and not block_diffusion and (cfg.length or seq_len) > seq_len:
    return cfg.block_length or seq_len // 2
  return 0


def settings(config: ml_collections.ConfigDict) -> dict:
  """The sampler settings, as recorded next to every sample (an ar model decodes token by token:
  the mdm methods' own settings are not its): what reproduces the samples, the prompt's chat
  rendering and the blocks included."""
  cfg = config.sample
  method = "ar" if config.model.type == "ar" else cfg.method
  block_length = _block_length(config)
  return {
    "method": method,
    "num_steps": cfg.num_steps,
    "temperature": cfg.temperature,
    "threshold": cfg.threshold if method == "threshold" else None,
    **(
      {"confidence": cfg.confidence, "reveal_counts": cfg.reveal_counts}
      if method == "confidence"
      else {}
    ),
    **(
      {
        "remask": cfg.remask,
        "remask_eta": cfg.remask_eta,
        "remask_loop": cfg.remask_loop,
        "remask_loop_alpha": cfg.remask_loop_alpha,
      }
      if method == "remdm"
      else {}
    ),
    "guidance_scale": cfg.guidance_scale,
    "top_k": cfg.top_k or None,
    "top_p": cfg.top_p if cfg.top_p < 1.0 else None,
    "length": cfg.length or config.data.seq_len,
    "prompt": cfg.prompt,
    **({"cache": cfg.cache, "block_length": cfg.block_length} if cfg.cache != "none" else {}),
    **({"chat": True} if cfg.chat and cfg.prompt else {}),
    **({"blocks_after_prompt": True} if cfg.blocks_after_prompt else {}),
    **({"block_length": block_length} if block_length and cfg.cache == "none" else {}),
  }


def encode_prompt(config: ml_collections.ConfigDict, source) -> np.ndarray:
  """config.sample.prompt's ids; ValueError naming sample.prompt if it cannot be encoded or
  leaves nothing to generate."""
  prompt, length = config.sample.prompt, config.sample.length or config.data.seq_len
  if not prompt:
    return np.zeros((0,), np.int32)
  if config.sample.chat:
    prompt = chat.apply(config.data.chat_template, prompt)
  try:
    ids = np.asarray(source.encode(prompt), np.int32)
  except ValueError as e:
    raise ValueError(f"sample.prompt={prompt!r} cannot be encoded: {e}") from None
  if len(ids) >= length:
    raise ValueError(
      f"sample.prompt is {len(ids)} tokens but samples are {length} "
      "(sample.length, or data.seq_len when 0): nothing would be generated; "
      "shorten the prompt or raise sample.length."
    )
  return ids


def _timed(fn, *args):
  """Compiles fn, then runs it once: (outputs, seconds of the run alone)."""
  compiled = jax.jit(fn).lower(*args).compile()
  start = time.perf_counter()
  outputs = jax.block_until_ready(compiled(*args))
  return sharding.to_host(outputs), time.perf_counter() - start


def decoding(config: ml_collections.ConfigDict, model, length: int, prompt_width: int = 0) -> dict:
  """How the CLI decodes `length` tokens after a prompt prompt_width wide (0: none): `sample`'s
  method, block_size, cache, context_length and block_offset. An ar model token after token with
  the exact KV cache; block diffusion in its blocks with the exact cache; sample.cache's blocks;
  an mdm past its context in windows of data.seq_len; else one block. With
  sample.blocks_after_prompt the blocks start after the prompt (block_offset, where there is
  one), and the length after it must be whole blocks (as LLaDA's generate asserts; the caches'
  blocks always): ValueError naming the keys otherwise."""
  how = _decoding(config, model, length)
  cfg = config.sample
  if not (cfg.blocks_after_prompt and config.model.type == "mdm"):
    return how
  if prompt_width:
    how["block_offset"] = prompt_width
  if (prompt_width or how["cache"] != "none") and (length - prompt_width) % how["block_size"]:
    raise ValueError(
      f"sample.blocks_after_prompt: the {length - prompt_width} tokens after the "
      f"{prompt_width}-token prompt are no whole number of sample.block_length="
      f"{how['block_size']} blocks; change sample.length (0: data.seq_len) or the block length."
    )
  return how


def _decoding(config: ml_collections.ConfigDict, model, length: int) -> dict:
  """`decoding` but the blocks' offset."""
  cfg, seq_len = config.sample, config.data.seq_len
  if config.model.type == "ar":  # One reveal per one-token block: one call per token.
    cache = "exact" if caches_keys_and_values(model) else "none"  # A test's oracle: re-run.
    return dict(method="first_hitting", block_size=1, cache=cache, context_length=seq_len)
  blocks = dict(method=cfg.method, context_length=seq_len)
  if model.block_size:
    return dict(blocks, block_size=model.block_size, cache="exact")
  if cfg.cache != "none":
    return dict(blocks, block_size=cfg.block_length, cache=cfg.cache, context_length=None)
  if cfg.blocks_after_prompt and cfg.block_length and length <= seq_len:  # LLaDA's blocks.
    return dict(blocks, block_size=cfg.block_length, cache="none", context_length=None)
  if length > seq_len:
    return dict(blocks, block_size=cfg.block_length or seq_len // 2, cache="none")
  return dict(method=cfg.method, block_size=None, cache="none", context_length=None)


def sampler_kwargs(config: ml_collections.ConfigDict, params, temperature=None) -> dict:
  """`sample`'s settings of config.sample but the decoding (`decoding`): a learned schedule is
  read from the params (concrete here), like the network."""
  cfg, run = config.sample, settings(config)
  uniform = config.diffusion.process == "uniform"  # No mask id: every token is a clean one.
  return dict(
    schedule=objective.schedule_of(params, config),
    mask_id=None if uniform else config.data.vocab_size,
    process=config.diffusion.process,
    num_steps=cfg.num_steps,
    threshold=run["threshold"],
    guidance_scale=cfg.guidance_scale,
    temperature=cfg.temperature if temperature is None else float(temperature),
    top_k=run["top_k"],
    top_p=run["top_p"],
    **{
      k: run[k]
      for k in (
        "remask",
        "remask_eta",
        "remask_loop",
        "remask_loop_alpha",
        "confidence",
        "reveal_counts",
      )
      if k in run
    },
  )


def generate(
  config: ml_collections.ConfigDict, model, params, source, key, *, record_trajectory: bool = False
):
  """Samples config.sample.num_samples sequences: (tokens [n, length], nfe, seconds, trajectory)."""
  cfg, length = config.sample, settings(config)["length"]
  prompt_ids = encode_prompt(config, source)
  # Host arrays: with params spread over several processes, jit places them on every device.
  prompt = np.asarray(prompt_ids, np.int32) if len(prompt_ids) else None
  how = decoding(config, model, length, len(prompt_ids))
  record_trajectory = (
    record_trajectory
    and how["block_size"] is None
    and config.model.type == "mdm"
    and config.diffusion.process == "masked"
  )
  kwargs = dict(
    sampler_kwargs(config, params),
    **how,
    batch_size=cfg.num_samples,
    length=length,
    record_trajectory=record_trajectory,
  )
  (tokens, info), seconds = _timed(
    lambda denoiser, key, prompt: decoder.sample(key, denoiser, prompt=prompt, **kwargs),
    objective.sampling_denoiser(model, params, config),
    np.asarray(key),
    prompt,
  )
  samplers.check_logits(info, how["method"])
  arguments.check_filled(info)  # The prompt was traced: its positions before the blocks.
  return np.asarray(tokens), int(info["nfe"]), seconds, info.get("trajectory")


def sample_records(
  tokens: np.ndarray, source, step: int, config: ml_collections.ConfigDict, nfe: int, seconds: float
) -> list[dict]:
  """One JSON-ready record per sample: tokens, text, NFE, seconds, settings, true bits/token."""
  true_bits = (
    source.true_bits_per_token_of(tokens) if tokens.shape[1] == config.data.seq_len else None
  )
  records = []
  for i, row in enumerate(tokens):
    record = {
      "step": step,
      "tokens": [int(t) for t in row],
      "text": source.decode(row),
      "nfe": nfe,
      "seconds": seconds,
      **settings(config),
    }
    if true_bits is not None:
      record["true_bits_per_token"] = float(true_bits[i])  # −log2 p(sample) / L under the truth.
    records.append(record)
  return records


def write_trajectory(
  workdir, trajectory: dict, source, *, mask_id: int, nfe: int
) -> list[pathlib.Path]:
  """trajectory.html (interactive) and trajectory.gif of the first sample, in workdir."""
  steps = min(nfe, trajectory["top_ids"].shape[0])  # first_hitting records past its last event.
  trimmed = {
    "tokens": trajectory["tokens"][: steps + 1],
    "top_ids": trajectory["top_ids"][:steps],
    "top_probs": trajectory["top_probs"][:steps],
    "alphas": trajectory["alphas"][:steps],
  }
  workdir = workdir_lib.as_workdir(workdir)
  html = trajectory_lib.write_html(
    workdir.trajectory_html, trimmed, mask_id=mask_id, decode=source.token_text
  )
  gif = trajectory_lib.render_gif(
    trimmed, workdir.trajectory_gif, mask_id=mask_id, decode=source.token_text
  )
  return [pathlib.Path(html), pathlib.Path(gif)]
