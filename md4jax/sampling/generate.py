"""Sample generation for the CLI: the mdm samplers or AR decoding, prompts, records, trajectory pages.

`config.sample` chooses the method, steps, temperature, top-k/top-p, prompt
and length. A length past the model's context is generated block by block
(mdm: semi-autoregressively, MDLM style). Every record carries the text, the
number of network calls (NFE) and the seconds the sampler ran (compilation
excluded for single-window sampling).
"""

import pathlib
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.sampling import block_sampler, blockwise, categorical, prefix_cache, samplers
from md4jax.sampling import trajectory as trajectory_lib
from md4jax.training import objective


def ar_sample(
  key,
  model,
  params,
  *,
  batch_size: int,
  length: int,
  bos_id: int,
  temperature: float,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
  prompt: Optional[jax.Array] = None,
  prompt_mask: Optional[jax.Array] = None,
) -> jax.Array:
  """Token-by-token sampling from a causal model into a fixed buffer, [B, length] int32.

  Each step reruns the model on the whole buffer (no KV cache): simple and
  shape-static, fine at the lengths trained here. Prompt positions are clamped.
  """
  if prompt is None:
    prompt, prompt_mask = jnp.zeros((length,), jnp.int32), jnp.zeros((length,), bool)

  def step(i, buffer):
    logits = model.apply({"params": params}, buffer[:, :length])
    next_logits = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)
    token = categorical.sample_categorical(
      jax.random.fold_in(key, i), next_logits, temperature=temperature, top_k=top_k, top_p=top_p
    )
    token = jnp.where(prompt_mask[i], prompt[i], token)
    return jax.lax.dynamic_update_index_in_dim(buffer, token, i + 1, axis=1)

  buffer = jnp.full((batch_size, length + 1), bos_id, jnp.int32)
  return jax.lax.fori_loop(0, length, step, buffer)[:, 1:]


def settings(config: ml_collections.ConfigDict) -> dict:
  """The sampler settings, as recorded next to every sample."""
  cfg = config.sample
  return {
    "method": "ar" if config.model.type == "ar" else cfg.method,
    "num_steps": cfg.num_steps,
    "temperature": cfg.temperature,
    "threshold": cfg.threshold if cfg.method == "threshold" else None,
    **(
      {
        "remask": cfg.remask,
        "remask_eta": cfg.remask_eta,
        "remask_loop": cfg.remask_loop,
        "remask_loop_alpha": cfg.remask_loop_alpha,
      }
      if cfg.method == "remdm"
      else {}
    ),
    "guidance_scale": cfg.guidance_scale,
    "top_k": cfg.top_k or None,
    "top_p": cfg.top_p if cfg.top_p < 1.0 else None,
    "length": cfg.length or config.data.seq_len,
    "prompt": cfg.prompt,
    **({"cache": cfg.cache, "block_length": cfg.block_length} if cfg.cache != "none" else {}),
  }


def encode_prompt(config: ml_collections.ConfigDict, source) -> np.ndarray:
  """config.sample.prompt's ids; ValueError naming sample.prompt if it cannot be encoded or
  leaves nothing to generate."""
  prompt, length = config.sample.prompt, config.sample.length or config.data.seq_len
  if not prompt:
    return np.zeros((0,), np.int32)
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


def _timed_on_host(run):
  """run() -> (tokens, info), a sampler that compiles and checks itself: (host tokens, network
  calls, seconds, no trajectory)."""
  start = time.perf_counter()
  tokens, info = run()
  return sharding.to_host(tokens), int(info["nfe"]), time.perf_counter() - start, None


def generate(
  config: ml_collections.ConfigDict, model, params, source, key, *, record_trajectory: bool = False
):
  """Samples config.sample.num_samples sequences: (tokens [n, length], nfe, seconds, trajectory)."""
  cfg, run = config.sample, settings(config)
  vocab_size, seq_len, length = config.data.vocab_size, config.data.seq_len, run["length"]
  prompt_ids = encode_prompt(config, source)
  # Host arrays: with params spread over several processes, jit places them on every device.
  prompt = np.zeros((length,), np.int32)
  prompt[: len(prompt_ids)] = prompt_ids
  prompt_mask = np.arange(length) < len(prompt_ids)
  key = np.asarray(key)
  filters = dict(temperature=cfg.temperature, top_k=run["top_k"], top_p=run["top_p"])
  if config.model.type == "ar":
    tokens, seconds = _timed(
      lambda p, k, pr, pm: ar_sample(
        k,
        model,
        p,
        batch_size=cfg.num_samples,
        length=length,
        bos_id=vocab_size,
        prompt=pr,
        prompt_mask=pm,
        **filters,
      ),
      params,
      key,
      prompt,
      prompt_mask,
    )
    return np.asarray(tokens), length, seconds, None
  # A learned schedule is read from the params (concrete here), like the network.
  schedule = objective.schedule_of(params, config)
  denoiser = lambda p: objective.sampling_denoiser(model, p, config)
  remask = {
    k: run[k] for k in ("remask", "remask_eta", "remask_loop", "remask_loop_alpha") if k in run
  }
  sample_kwargs = dict(
    schedule=schedule,
    mask_id=vocab_size,
    method=cfg.method,
    num_steps=cfg.num_steps,
    threshold=run["threshold"],
    guidance_scale=cfg.guidance_scale,
    **remask,
    **filters,
  )
  if model.block_size:  # Block diffusion: block after block, with the KV cache, at any length.
    return _timed_on_host(
      lambda: block_sampler.sample_blocks_cached(
        key,
        model,
        params,
        batch_size=cfg.num_samples,
        length=length,
        block_size=model.block_size,
        context_length=seq_len,
        prompt=prompt_ids,
        **sample_kwargs,
      )
    )
  if cfg.cache != "none":  # Block-wise decoding within the context, Fast-dLLM's caches.
    return _timed_on_host(
      lambda: prefix_cache.sample_with_cache(
        key,
        model,
        params,
        batch_size=cfg.num_samples,
        length=length,
        block_size=cfg.block_length,
        cache=cfg.cache,
        prompt=prompt_ids,
        **sample_kwargs,
      )
    )
  if length > seq_len:
    return _timed_on_host(
      lambda: blockwise.generate_semi_autoregressive(
        key,
        denoiser(params),
        batch_size=cfg.num_samples,
        total_length=length,
        context_length=seq_len,
        block_length=cfg.block_length or seq_len // 2,
        prompt=prompt_ids,
        **sample_kwargs,
      )
    )
  (tokens, info), seconds = _timed(
    lambda p, k, pr, pm: samplers.sample(
      k,
      denoiser(p),
      batch_size=cfg.num_samples,
      length=length,
      prompt=pr,
      prompt_mask=pm,
      record_trajectory=record_trajectory,
      **sample_kwargs,
    ),
    params,
    key,
    prompt,
    prompt_mask,
  )
  samplers.check_logits(info, cfg.method)
  trajectory = info.get("trajectory")
  return np.asarray(tokens), int(info["nfe"]), seconds, trajectory


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
