"""What md4jax.aot's programs cost: the TPU chips' HBM and peak FLOP/s, a compiled program's
bytes per chip and XLA's FLOP count of it, and the model's FLOP formulas for a train step and a
sampler call."""

from md4jax.model import transformer as model_lib

# Per chip: HBM bytes and peak dense bfloat16 FLOP/s (Cloud TPU documentation).
CHIPS = {
  "TPU v4": {"hbm_bytes": 32 * 2**30, "peak_bf16_flops": 275e12},
  "TPU v5 lite": {"hbm_bytes": 16 * 2**30, "peak_bf16_flops": 197e12},
  "TPU v5": {"hbm_bytes": 95 * 2**30, "peak_bf16_flops": 459e12},
  "TPU v6 lite": {"hbm_bytes": 32 * 2**30, "peak_bf16_flops": 918e12},
}


def chip_specs(devices) -> dict:
  """HBM and peak FLOP/s per JAX device (a v4 chip shows up as two devices, one per core)."""
  kind = devices[0].device_kind
  if kind not in CHIPS:
    raise ValueError(f"No HBM/FLOP figures for {kind!r}; known: {', '.join(CHIPS)}.")
  devices_per_chip = len({d.core_on_chip for d in devices})
  return {
    "device_kind": kind,
    "devices_per_chip": devices_per_chip,
    "hbm_bytes": CHIPS[kind]["hbm_bytes"] // devices_per_chip,
    "peak_bf16_flops": CHIPS[kind]["peak_bf16_flops"] / devices_per_chip,
  }


def compiled_memory(compiled) -> dict:
  """A compiled program's bytes per chip, by kind; "total": arguments + outputs + temporaries −
  aliased (donated) bytes."""
  stats = compiled.memory_analysis()
  memory = {
    name: int(getattr(stats, f"{name}_size_in_bytes"))
    for name in ("argument", "output", "temp", "alias", "generated_code")
  }
  memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
  return memory


def compiled_flops(compiled) -> float:
  """XLA's FLOP count of a compiled program (cost_analysis is a dict, or a list of one)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def _forward_flops_per_token(config, keys: int, logits: bool = True) -> float:
  """`flops_per_token` of a token reading `keys` positions, its attention projections at
  model.num_kv_heads (grouped-query attention projects fewer keys and values), without the
  logits layer when logits is False."""
  m, vocab = config.model, config.data.vocab_size
  head_dim = m.model_dim // m.num_heads
  kv_width = (m.num_kv_heads or m.num_heads) * head_dim
  flops = model_lib.flops_per_token(m.num_layers, m.model_dim, m.mlp_dim, keys, vocab)
  flops -= 2 * m.num_layers * 2 * m.model_dim * (m.model_dim - kv_width)  # k and v: D x kv_width.
  return flops - (0 if logits else 2 * m.model_dim * vocab)


def model_flops_per_step(config, model) -> float:
  """3 × the forward FLOPs of a step's tokens (`flops_per_token`, its key and value projections
  at model.num_kv_heads); block diffusion's forward reads 2L tokens (z_t ⊕ x, attention over 2L)
  and computes logits for the first L only."""
  seq_len = config.data.seq_len
  streams = 2 if model.block_size else 1
  per_token = _forward_flops_per_token(config, streams * seq_len)
  logits = 2 * config.model.model_dim * config.data.vocab_size  # Per token, of the noisy stream.
  forward = streams * seq_len * per_token - (streams - 1) * seq_len * logits
  return 3 * forward * config.batch_size


def sampler_flops(config, model, program: str) -> float:
  """The forward FLOPs of a sampler program on eval.batch_size rows (the formula's, as training's):
  "sampler_step" one call (cache "none": seq_len tokens; block diffusion: a block reading the
  seq_len − b cached positions; prefix/dual: sample.block_length tokens reading seq_len cached
  ones), "sampler_refresh" the seq_len tokens' keys and values (no logits)."""
  rows, length = config.eval.batch_size, config.data.seq_len
  if program == "sampler_refresh":
    return rows * length * _forward_flops_per_token(config, length, logits=False)
  if model.block_size:
    return rows * model.block_size * _forward_flops_per_token(config, length)
  if config.sample.cache in ("prefix", "dual"):
    block = config.sample.block_length
    return rows * block * _forward_flops_per_token(config, length + block)
  return rows * length * _forward_flops_per_token(config, length)


def call_tokens(config, model, program: str) -> int:
  """Tokens per row the sampler program's network call computes."""
  if model.block_size:
    return model.block_size
  if program == "sampler_step" and config.sample.cache in ("prefix", "dual"):
    return config.sample.block_length
  return config.data.seq_len


def post_train_flops(config, model) -> float:
  """A post-training step's model FLOPs (`md4jax.posttraining.step`): the rollouts' sampler
  calls, counted as sample.num_steps calls over whole rows (a whole-sequence sampler's; blocks,
  caches and first_hitting call otherwise), then the log π estimates, likelihood_draws calls
  each (twice for coupled, one for d1): the KL's pair forward when β > 0, the rollout-time one
  forward when updates_per_rollout > 1, and each update forward and backward (3×; a LoRA
  run's backward is lighter)."""
  cfg = config.post_train
  rows, length = config.batch_size * cfg.group_size, config.data.seq_len
  call = rows * length * _forward_flops_per_token(config, length)
  per_estimate = {"nelbo": cfg.likelihood_draws, "coupled": 2 * cfg.likelihood_draws, "d1": 1}
  estimates = 2 * (cfg.beta > 0) + (cfg.updates_per_rollout > 1) + 3 * cfg.updates_per_rollout
  return call * (config.sample.num_steps + estimates * per_estimate[cfg.likelihood])
