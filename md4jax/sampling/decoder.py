"""The block decoder: `sample`, every sampler method run block after block with a cache strategy.

A sample of L tokens is K = ⌈(L − o) / b⌉ blocks of b tokens after a block offset o (0, or the
prompt's width: LLaDA's blocks start after the prompt; one block of L − o by default), sampled
one after another, each by any method of `md4jax.sampling.samplers` given the blocks before it. What
a network call on block k reads is the cache strategy's:

  "none"    the denoiser runs on a window of context_length positions ending with the block
            (the whole sample by default): the blocks before it, the block, and the positions
            after it masked (a given prompt token stays shown). MDLM's sliding windows past the
            context; with a block-causal network, block diffusion's reference.
  "exact"   BD3-LM's KV cache, for a network whose blocks never read later ones (block-causal
            with blocks of b, or causal): each finished block's keys and values are computed
            once and every later call runs the network on b tokens that read them. Past the
            context the cache is a ring of the last context_length − b positions. A shifted
            network (an AR model, or Dream's shifted prediction) with b = 1 reads only the clean
            token before the block, so its one call both samples the block and writes the
            cache: AR decoding with a KV cache.
  "prefix"  Fast-dLLM's approximate caches, for a time-free bidirectional network: at the start
  "dual"    of each block one call on the whole sequence refreshes every position's keys and
            values; a call then runs the block alone and reads those of the positions before it
            (prefix), or of every position outside it (dual). They were computed while the block
            was masked, so prefix and dual approximate "none" (benchmarks/leaderboard.py).

A `Denoiser`'s per-row `inputs` (segment_ids and positions [1 or B, length]: rows that start or
end in padding) are read by cache "none" only: each call reads its window's columns of them
(past `length`, the last segment and positions counting on).

One jitted program per shape and setting, cached by jax.jit: the denoiser travels as an argument
(a `Denoiser`'s params are pytree leaves), so fresh params of one shape never compile again.
The block loop itself is `md4jax.sampling.blocks`.

Keys: every draw is per row, so a row's tokens depend only on the key, its row index in the
request and its prompt (and inputs), never on the batch size or the other rows (except method
"cached" with a time-conditioned denoiser, whose calls follow the batch: it is exact for a
time-free one only). Row b of the
call is row r = row_offset + b of the request and draws from key_r = fold_in(key, r): its block k
from fold_in(key_r, k), and a sample of one block from key_r itself (so b = L is
`samplers.run` with the row keys, token for token).
"""

import functools
import inspect
import weakref
from typing import Optional

import jax

from md4jax.diffusion.denoiser import Denoiser, as_denoiser
from md4jax.diffusion.schedules import get_schedule
from md4jax.sampling import arguments, blocks, samplers, uniform_state

Array = jax.Array


# A Denoiser's program: its params are arguments, so one program serves every param tree of a
# shape. A plain function's own programs live as long as the function (a closure over params
# keeps them as constants of its programs): _PLAIN_PROGRAMS holds the function, or a bound
# method's object, weakly, with {the function (or method): its program}.
_decode_jit = jax.jit(blocks.decode, static_argnums=0)
_PLAIN_PROGRAMS = weakref.WeakKeyDictionary()


def _decode_plain(reference, plan: blocks.Plan, key, row_offset, prompt, prompt_mask):
  """`blocks.decode` of the plain function `reference` (a weakref, alive while its program is
  used)."""
  return blocks.decode(plan, key, row_offset, as_denoiser(reference()), prompt, prompt_mask)


def _this_call(plan: blocks.Plan):
  """A program for this call only, kept by nothing."""
  return jax.jit(functools.partial(blocks.decode, plan))


def _program(plan: blocks.Plan, denoise_fn):
  """decode(key, row_offset, denoiser, prompt, prompt_mask), jitted for this plan and denoiser.
  A program whose schedule holds arrays (a learned schedule, made anew from each params) is this
  call's own: kept, it would be compiled again for the next schedule and keep this one alive."""
  try:
    hash(plan)
  except TypeError:  # An unhashable setting.
    return _this_call(plan)
  if plan.settings.schedule.state_dependent:
    return _this_call(plan)
  if isinstance(denoise_fn, Denoiser):
    return functools.partial(_decode_jit, plan)
  method = inspect.ismethod(denoise_fn)  # Made anew at each attribute access: keyed by its object.
  owner, name = (denoise_fn.__self__, denoise_fn.__func__) if method else (denoise_fn, None)
  try:
    programs = _PLAIN_PROGRAMS.setdefault(owner, {})
  except TypeError:  # Not weakly referenceable.
    return _this_call(plan)
  if name not in programs:
    reference = weakref.WeakMethod(denoise_fn) if method else weakref.ref(denoise_fn)
    programs[name] = jax.jit(functools.partial(_decode_plain, reference), static_argnums=0)
  program = programs[name]
  return lambda key, row_offset, denoiser, prompt, prompt_mask: program(
    plan, key, row_offset, prompt, prompt_mask
  )


def sample(
  key: Array,
  denoise_fn,
  *,
  batch_size: int,
  length: int,
  schedule,
  mask_id: Optional[int] = None,
  method: str = "ancestral",
  num_steps: Optional[int] = None,
  temperature: float = 1.0,
  top_k: Optional[int] = None,
  top_p: Optional[float] = None,
  prompt: Optional[Array] = None,
  prompt_mask: Optional[Array] = None,
  block_size: Optional[int] = None,
  cache: str = "none",
  context_length: Optional[int] = None,
  eos_id: Optional[int] = None,
  time_grid_kind: str = "uniform",
  confidence: str = "max_prob",
  reveal_counts: str = "schedule",
  threshold: Optional[float] = None,
  noise: str = "float64",
  remask: str = "cap",
  remask_eta: float = 0.0,
  remask_loop: int = 0,
  remask_loop_alpha: float = 0.9,
  guidance_scale: float = 0.0,
  record_trajectory: bool = False,
  trajectory_top_k: int = 5,
  row_offset=0,
  block_offset: int = 0,
  process: str = "masked",
):
  """Generates [B, length] int32 tokens from all-mask, block after block (the module docstring).

  Args:
    key: one PRNG key for the whole request; row r draws from fold_in(key, r) alone (the module
      docstring), so a row's tokens are the same at any batch size.
    denoise_fn: a `Denoiser` (params as pytree leaves: compiled once per shape), or any
      callable denoise_fn(z [B, L], alpha [B]) -> logits [B, L, V] (V = mask_id), compiled
      once per callable object. A self-conditioned network's Denoiser with passes=2
      (the default) reads its own first call's estimate: two network calls per sampler call,
      both in info["nfe"] (info["sampler_calls"]: the sampler's own count); with passes=1 every
      method hands each call's estimate to the next (zeros at the first), one call a step (one
      block, no guidance). cache "exact", "prefix" and "dual" need a network's Denoiser
      without per-row inputs; a Denoiser's inputs [1 or B, length] (segment_ids 0 marking
      padding, positions) serve cache "none".
    prompt, prompt_mask: tokens [P] or [B, P] (P <= length) and where they are given (default:
      wherever prompt != mask_id); those positions never change (infilling when scattered).
    block_size: tokens per block (default: length, one block); the last block may run past
      length and is cut.
    cache: "none", "exact", "prefix" or "dual" (the module docstring).
    context_length: positions a call may read: cache "none"'s window, "exact"'s cache plus the
      block (a multiple of block_size); default: the whole sample.
    eos_id: generation stops once every row generated an EOS (after its prompt); tokens after
      a row's first EOS become EOS, and info["lengths"] [B] counts each row up to it.
    num_steps: steps of the time grid of each block; ignored by first_hitting and threshold.
    threshold: method="threshold" only: reveal every masked position whose top probability is
      >= threshold (in [0, 1]; 0 reveals everything in one call).
    noise: "float64" (accurate tails, default) or "float32" (for comparison only).
    remask, remask_eta, remask_loop, remask_loop_alpha: method="remdm" only: the strategy of
      σ_t ("cap": min(η, σ_max), "rescale": η σ_max, "confidence": σ_max shared by the visible
      tokens, the least confident first; η unused), and ReMDM-loop's extra steps at the fixed
      α the grid first reaches above remask_loop_alpha (then only they remask).
    guidance_scale: w of classifier-free guidance (any method, any cache; a shifted denoiser:
      cache "none"): each call mixes the denoiser's log-probs as (1 + w) cond − w uncond, uncond
      with the prompt masked (one call on the doubled batch; the caches keep both halves); 0 is
      the conditional model, bit for bit. Needs a prompt.
    confidence: method="confidence"'s ranking: "max_prob", "margin", "neg_entropy" (of the law
      after temperature / top-k / top-p), "drawn_prob" (the plain softmax probability of the
      token drawn: LLaDA's low_confidence) or "drawn_filtered_prob" (its probability under that
      law: Dream's maskgit_plus).
    reveal_counts: method="confidence"'s positions revealed per step: "schedule" (default), "even"
      (LLaDA's) or "proportional" (Dream's); `unmasking.reveal_count`.
    block_offset: where the first block starts (LLaDA's and Fast-dLLM's blocks start after the
      prompt: its width), the positions before it given by the prompt; cache none, prefix or dual.
    process: "masked" (every method above) or "uniform": the uniform-state process (no mask id;
      denoise_fn(z in [0, V), alpha) -> logits [B, L, V]), sampled from uniform noise by
      `md4jax.sampling.uniform_state` (method "ancestral", "greedy_tail" or "canvas", num_steps
      required; a prompt's positions, or those where prompt_mask is True, are given); no EOS,
      guidance, trajectory or block offset. With block_size < length or cache "exact" (block
      diffusion under uniform noise) each block is sampled given the ones before it, and
      denoise_fn(z, keep [B, L]) reads each position's probability of holding its clean token
      (1 before the block, the step's α in it, 0 after; a cached block call reads [B, b]).
      info holds "nfe" and "nonfinite_call" (and, with blocks, the block decoder's).
    row_offset: the request's row index of this call's row 0: rows row_offset .. row_offset + B − 1
      of a larger request (an integer >= 0; a traced one under jit). A call at batch 2 with
      row_offset 3 returns rows 3 and 4 of the same call at batch 8, bit for bit wherever a
      row's logits are (a network's may round differently at another batch size: on XLA's CPU
      by ~1e-5, which decides a draw or a rank only at a near-tie).
    record_trajectory: one block only: also return info["trajectory"]: "tokens" [S + 1, B, L]
      (the state before the first step and after each step), the denoiser's "top_ids" /
      "top_probs" [S, B, L, K] and "alphas" [S, B] at each step (the times t for a
      state-dependent schedule), S = max_calls(method, length, num_steps, remask_loop,
      reveal_counts) (steps past info["nfe"] repeat the end).

  Returns:
    (tokens [B, length] int32, info): info["nfe"] the network calls that sample (a block's
    calls, each at most `max_calls`, and prefix/dual's refreshes), info["cache_writes"] the
    exact cache's extra calls, info["cache_bytes"], info["num_blocks"] sampled, and
    info["nonfinite_call"] the index of the first call whose logits at a masked position were
    broken (−1: none); with block_offset, info["unfilled"] the positions before it that the
    prompt left masked (no block samples them: they hold the mask id). Called with concrete
    arrays it raises NonFiniteLogitsError for broken logits and ValueError for unfilled
    positions; inside a caller's jit, check the info with `samplers.check_logits` and
    `arguments.check_filled`.
  """
  if process == "uniform":
    uniform = dict(
      batch_size=batch_size,
      length=length,
      prompt=prompt,
      prompt_mask=prompt_mask,
      refused=dict(
        mask_id=(mask_id, None),
        eos_id=(eos_id, None),
        guidance_scale=(guidance_scale, 0.0),
        record_trajectory=(record_trajectory, False),
        block_offset=(block_offset, 0),
        row_offset=(row_offset, 0),
        time_grid_kind=(time_grid_kind, "uniform"),
      ),
      schedule=schedule,
      method=method,
      num_steps=num_steps,
      temperature=float(temperature),
      top_k=top_k,
      top_p=top_p,
      noise=noise,
    )
    if block_size in (None, length) and cache == "none":
      return _sample_uniform(key, denoise_fn, **uniform)
    return _sample_uniform_blocks(
      key, denoise_fn, block_size=block_size, cache=cache, context_length=context_length, **uniform
    )
  if process != "masked":
    raise ValueError(f"sample: unknown process {process!r}; valid: masked, uniform.")
  if mask_id is None:
    raise ValueError("sample: the masked process needs mask_id (== V, one past the vocabulary).")
  denoiser = as_denoiser(denoise_fn)
  block_size, num_blocks, window = arguments.check_blocks(
    length, block_size, context_length, block_offset
  )
  padded = block_offset + num_blocks * block_size
  arguments.check_block_offset(block_offset, cache, prompt)
  arguments.check_key(key)
  row_offset = arguments.check_row_offset(row_offset)
  arguments.check_inputs(denoiser, cache, batch_size, length)
  arguments.check_cache(cache, denoiser, block_size, window, padded)
  samplers.check_settings(
    schedule=schedule,
    method=method,
    num_steps=num_steps,
    threshold=threshold,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    noise=noise,
    time_grid_kind=time_grid_kind,
    confidence=confidence,
    reveal_counts=reveal_counts,
    remask=remask,
    remask_eta=remask_eta,
    remask_loop=remask_loop,
    remask_loop_alpha=remask_loop_alpha,
    guidance_scale=guidance_scale,
    has_prompt=prompt is not None,
  )
  settings = samplers.Settings(
    schedule=schedule,
    mask_id=mask_id,
    method=method,
    num_steps=None if num_steps is None else int(num_steps),
    temperature=float(temperature),
    top_k=None if top_k is None else int(top_k),
    top_p=top_p,
    time_grid_kind=time_grid_kind,
    confidence=confidence,
    reveal_counts=reveal_counts,
    threshold=threshold,
    noise=noise,
    remask=remask,
    remask_eta=float(remask_eta),
    remask_loop=int(remask_loop),
    remask_loop_alpha=float(remask_loop_alpha),
    record_trajectory=record_trajectory,
    trajectory_top_k=trajectory_top_k,
  )
  if denoiser.self_conditioned and denoiser.passes == 1 and (guidance_scale or num_blocks > 1):
    raise ValueError(
      "sample: a self-conditioned Denoiser with passes=1 hands each call's estimate of x_0 to "
      "the next within one block, without guidance; use passes=2 (two calls a step)."
    )
  arguments.check_decoding(
    denoiser,
    cache=cache,
    guidance_scale=guidance_scale,
    record_trajectory=record_trajectory,
    num_blocks=num_blocks,
    eos_id=eos_id,
    mask_id=mask_id,
  )
  if prompt is not None:
    arguments.check_prompt_shape(prompt, prompt_mask, batch_size, length)
  slots = _exact_slots(cache, padded, context_length, block_size)
  plan = blocks.Plan(
    settings=settings,
    batch_size=batch_size,
    length=length,
    block_size=block_size,
    num_blocks=num_blocks,
    window=window,
    cache=cache,
    slots=slots,
    guidance=float(guidance_scale),
    eos_id=eos_id,
    offset=int(block_offset),
  )
  traced = lambda *xs: any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))
  if prompt is not None and not traced(key, prompt, prompt_mask):
    arguments.check_prompt(prompt, prompt_mask, mask_id)
  if prompt is not None and not traced(prompt, prompt_mask):
    # Positions before the first block are never sampled: all must be given. A traced prompt's
    # are counted in info["unfilled"] instead.
    arguments.check_given_before_offset(prompt, prompt_mask, mask_id, block_offset)
  tokens, info = _program(plan, denoise_fn)(key, row_offset, denoiser, prompt, prompt_mask)
  info["cache_bytes"] = _cache_bytes(plan, denoiser)
  if not isinstance(info["nfe"], jax.core.Tracer):
    samplers.check_logits(info, method)
    arguments.check_filled(info)
  if denoiser.self_conditioned and denoiser.passes == 2:  # Each call is two network calls.
    info["sampler_calls"], info["nfe"] = info["nfe"], 2 * info["nfe"]
  return tokens, info


def _sample_uniform(key, denoise_fn, **kwargs):
  if isinstance(kwargs["schedule"], str):
    kwargs["schedule"] = get_schedule(kwargs["schedule"])
  tokens, info = uniform_state.sample(key, denoise_fn, **kwargs)
  if not isinstance(info["nonfinite_call"], jax.core.Tracer):
    samplers.check_logits(info, kwargs["method"])
  return tokens, info


def _sample_uniform_blocks(
  key,
  denoise_fn,
  *,
  batch_size,
  length,
  prompt,
  prompt_mask,
  block_size,
  cache,
  context_length,
  refused,
  **settings,
):
  """`sample(process="uniform")` block after block (or through the exact cache): the block
  decoder, each block sampled by `uniform_state.run`."""
  if isinstance(settings["schedule"], str):
    settings["schedule"] = get_schedule(settings["schedule"])
  uniform_state.check_settings(refused, settings)
  if cache not in ("none", "exact"):
    raise ValueError(
      f"sample: process='uniform' takes cache 'none' or 'exact', got {cache!r} (Fast-dLLM's "
      "caches approximate a masked sampler's)."
    )
  denoiser = as_denoiser(denoise_fn)
  if denoiser.self_conditioned:
    raise ValueError(
      "sample: process='uniform' with block_size < length or a cache passes no estimate of x_0; "
      "a self-conditioned denoiser samples one block with cache='none'."
    )
  block_size, num_blocks, window = arguments.check_blocks(length, block_size, context_length, 0)
  arguments.check_key(key)
  arguments.check_inputs(denoiser, cache, batch_size, length)
  arguments.check_cache(cache, denoiser, block_size, window, num_blocks * block_size)
  vocab_size = uniform_state.vocab_size_of(denoise_fn, batch_size, length)
  if prompt is not None:
    arguments.check_prompt_shape(prompt, prompt_mask, batch_size, length)
    uniform_state.check_prompt_ids(prompt, vocab_size)
  slots = _exact_slots(cache, num_blocks * block_size, context_length, block_size)
  plan = blocks.Plan(
    settings=samplers.Settings(mask_id=vocab_size, **settings),
    batch_size=batch_size,
    length=length,
    block_size=block_size,
    num_blocks=num_blocks,
    window=window,
    cache=cache,
    slots=slots,
    guidance=0.0,
    eos_id=None,
    process="uniform",
  )
  tokens, info = _program(plan, denoise_fn)(key, 0, denoiser, prompt, prompt_mask)
  info["cache_bytes"] = _cache_bytes(plan, denoiser)
  if not isinstance(info["nonfinite_call"], jax.core.Tracer):
    samplers.check_logits(info, settings["method"])
  return tokens, info


def _exact_slots(cache: str, padded: int, context_length, block_size: int) -> int:
  """Positions the exact cache holds: at most those before the last block (0 without it)."""
  if cache != "exact":
    return 0
  return min(padded if context_length is None else context_length, padded) - block_size


def _cache_bytes(plan: blocks.Plan, denoiser: Denoiser) -> int:
  """Bytes of the keys and values a strategy keeps: the exact cache's slots, or every position
  (prefix, dual)."""
  if plan.cache == "none":
    return 0
  slots = plan.slots if plan.cache == "exact" else plan.padded
  return denoiser.cache_layout.bytes(plan.rows, slots)
