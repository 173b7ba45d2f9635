"""generate_until's sampling for the lm-evaluation-harness model: continuations of contexts by
md4jax's own samplers, with config.sample's settings (method, steps, top-k/top-p, threshold,
ReMDM, guidance) and a temperature per request group.

A masked diffusion model fills a row [context][n masks][padding] (`harness_model`'s layout)
with `md4jax.sample`, one row at a time under vmap, so each row's draws come from its own key
(its `row_id`) whatever the batch; the context and the padding are given and never change. A
block-diffusion model decodes block after block with the exact KV cache (one request at a time);
an ar model token after token (`generate.decoding`). sample.blocks_after_prompt (LLaDA's blocks,
each row's at its own context length) is refused, as the harness refuses sample.cache.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from md4jax import rng
from md4jax.app import generate, harness_model
from md4jax.runtime import sharding
from md4jax.sampling import decoder, samplers
from md4jax.training import objective

# fold_in(the harness key, this): the samplers' draws, apart from the bounds'.
_SAMPLE_STREAM = 0x5A3B1


class Generator:
  """Samples continuations of n tokens after each context, in rows of data.seq_len."""

  def __init__(self, loaded: harness_model.Loaded, seed: int):
    if loaded.config.sample.blocks_after_prompt:
      raise harness_model.HarnessError(
        "config.sample.blocks_after_prompt: generate_until samples each request's continuation "
        "as one block after its own context length (one program for every context length); its "
        "blocks cannot start after each prompt. Use sample.blocks_after_prompt=false."
      )
    self.loaded, self.config = loaded, loaded.config
    self.key = jax.random.fold_in(rng.stream(seed, harness_model.KEY_STREAM), _SAMPLE_STREAM)
    self._compiled = {}  # temperature -> the jitted batch sampler.

  def sampler_kwargs(self, temperature: float) -> dict:
    """`sample`'s settings: config.sample's, at this temperature, and the method."""
    kwargs = generate.sampler_kwargs(self.config, self.loaded.params, temperature)
    return dict(kwargs, method=generate.settings(self.config)["method"])

  def generate(
    self, contexts: list, lengths: list, repeats: list, temperature: float, batch_size: int
  ) -> list[np.ndarray]:
    """The lengths[i] token ids sampled after contexts[i] (ids; context + length within the
    context window, except for block diffusion, which slides past it). repeats[i]: how many
    equal requests came before this one, so that each of them draws afresh."""
    if self.config.model.type == "mdm" and self.loaded.model.block_size:
      return [
        self._block_diffusion(c, n, r, temperature) for c, n, r in zip(contexts, lengths, repeats)
      ]
    seq_len = self.config.data.seq_len
    out = []
    for start in range(0, len(contexts), batch_size):
      chunk = list(zip(contexts, lengths, repeats))[start : start + batch_size]
      prompts = np.zeros((batch_size, seq_len), np.int32)
      given = np.ones((batch_size, seq_len), bool)  # Filler rows: nothing to sample.
      real = np.zeros((batch_size, seq_len), np.int32)
      row_ids = np.zeros(batch_size, np.int32)
      for i, (context, n, repeat) in enumerate(chunk):
        prompts[i, : len(context)] = context
        given[i, len(context) : len(context) + n] = False
        real[i, : len(context) + n] = 1
        row = slice(0, len(context) + n)
        row_ids[i] = harness_model.row_id(prompts[i, row], ~given[i, row], repeat)
      tokens = self._batch_sampler(temperature)(prompts, given, real, row_ids)
      out += [tokens[i, len(c) : len(c) + n] for i, (c, n, _) in enumerate(chunk)]
    return out

  def _batch_sampler(self, temperature: float):
    """(prompts, given, segment_ids, row_ids) [B, L] host arrays -> tokens [B, L] host array."""
    if temperature not in self._compiled:
      self._compiled[temperature] = self._compile(temperature)
    run = self._compiled[temperature]
    mesh, params = self.loaded.mesh, self.loaded.params

    def sample(prompts, given, segments, row_ids):
      arrays = sharding.device_batch(
        {"prompt": prompts, "given": given, "segment_ids": segments, "row_ids": row_ids}, mesh
      )
      tokens, nfe, broken = sharding.to_host(run(params, arrays, self.key))
      if self.config.model.type == "mdm":
        samplers.check_logits({"nfe": nfe, "nonfinite_call": broken}, self.config.sample.method)
      return np.asarray(tokens)

    return sample

  def _compile(self, temperature: float):
    config, model, mesh = self.config, self.loaded.model, self.loaded.mesh
    seq_len = config.data.seq_len
    kwargs = self.sampler_kwargs(temperature)
    positions = jnp.arange(seq_len, dtype=jnp.int32)[None]

    def one_row(params, prompt, given, segments, key):
      if config.model.type == "ar":  # Causal: what follows a position never reaches it.
        denoise_fn = objective.sampling_denoiser(model, params, config)
        how = generate.decoding(config, model, seq_len)
      else:
        denoise_fn = objective.sampling_denoiser(model, params, config, segments[None], positions)
        how = dict(method=kwargs["method"])
      tokens, info = decoder.sample(
        key,
        denoise_fn,
        batch_size=1,
        length=seq_len,
        prompt=prompt[None],
        prompt_mask=given[None],
        **dict(kwargs, **how),
      )
      return tokens[0], info["nfe"], info["nonfinite_call"]

    def run(params, arrays, key):
      keys = jax.vmap(jax.random.fold_in, (None, 0))(key, arrays["row_ids"])
      with sharding.activation_rules(mesh):
        tokens, nfe, broken = jax.vmap(one_row, (None, 0, 0, 0, 0))(
          params, arrays["prompt"], arrays["given"], arrays["segment_ids"], keys
        )
      first_broken = jnp.min(jnp.where(broken >= 0, broken, jnp.iinfo(jnp.int32).max))
      return tokens, nfe.max(), jnp.where((broken >= 0).any(), first_broken, -1)

    rows = sharding.batch_sharding(mesh)
    return jax.jit(run, in_shardings=(None, rows, sharding.replicated(mesh)), out_shardings=None)

  def _block_diffusion(self, context, n: int, repeat: int, temperature: float) -> np.ndarray:
    """n tokens after the context, block after block with the exact KV cache."""
    kwargs = self.sampler_kwargs(temperature)
    if kwargs["guidance_scale"] and not len(context):
      raise harness_model.HarnessError(
        f"generate_until with an empty context and sample.guidance_scale="
        f"{kwargs['guidance_scale']}: guidance contrasts the context with the context masked, "
        "and block diffusion's sampler needs one; use sample.guidance_scale=0 for such tasks."
      )
    block_size = self.loaded.model.block_size
    length = math.ceil((len(context) + n) / block_size) * block_size
    scored = np.arange(length) >= len(context)
    padded = np.zeros(length, np.int32)
    padded[: len(context)] = context
    key = jax.random.fold_in(self.key, harness_model.row_id(padded, scored, repeat))
    tokens, _ = decoder.sample(
      key,
      objective.sampling_denoiser(self.loaded.model, self.loaded.params, self.config),
      batch_size=1,
      length=length,
      block_size=block_size,
      cache="exact",
      context_length=self.config.data.seq_len,
      prompt=np.asarray(context, np.int32) if len(context) else None,
      **kwargs,
    )
    return np.asarray(sharding.to_host(tokens))[0, len(context) : len(context) + n]
