r"""LLaDA-8B's shape (GSAI-ML/LLaDA-8B-Base and -Instruct): supervised fine-tuning on prompt/response
pairs, at the size of the released checkpoints. A bidirectional, time-free masked diffusion LM:
32 Llama-like blocks of width 4096, 32 heads (no grouped-query attention), SwiGLU MLP 12288,
RMSNorm eps 1e-5, RoPE θ 500000, vocabulary 126464, no biases, untied embeddings, 4096 tokens.

Whether it fits a TPU slice, on any CPU machine (pip install -e ".[tpu]"; the measured table and
its commands: docs/scaling.md, "LLaDA-8B and Dream-7B"):

  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/llada.py --topology=v6e:2x4

The mesh and remat here fit full SFT at 16 x 4096 tokens on a v5p-8 (4 chips of 95 GiB, 55 GiB used
per chip), a v6e-8 (8 chips of 32 GiB, 28 GiB used) and a v5e-16 (16 chips of 16 GiB, 14.3 GiB used,
of the 15.75 GiB libtpu allows): float32 params, AdamW moments and EMA take 16 bytes a parameter,
128 GB for 8.0B parameters, sharded over every chip (FSDP). Sampling (8 rows, with or without the
dual cache) fits all three (docs/scaling.md).

SFT of a converted checkpoint (docs/convert.md) on prompt/response JSONL, only the responses
masked and scored, as LLaDA's SFT:

  python -m md4jax.main --config=configs/llada.py --workdir=/mnt/shared/llada-sft \
      --config.training.init_from=/mnt/shared/llada-8b-instruct \
      --config.data.path=/mnt/shared/pairs.jsonl \
      --config.data.tokenizer_path=/mnt/shared/llada-8b-instruct/tokenizer.json
"""

from md4jax import config as config_lib

# LLaDA's tokenizer: 126464 ids (its embedding's rows); md4jax's mask id is one past them.
LLADA_VOCAB_SIZE = 126464


def get_config():
  config = config_lib.base_config()
  config.batch_size = 16  # Global batch: 16 rows of 4096 tokens (4 per v5p chip, 1 per v5e).
  config.num_train_steps = 2000  # A fine-tune's length; LLaDA's own SFT ran far longer.
  config.log_every_steps = 10  # An 8B step takes seconds: log often.
  config.eval_every_steps = 500  # Evaluate the held-out responses' NELBO every 500 steps.
  config.checkpoint_every_steps = 250  # A checkpoint holds 8.0B float32 params, moments and EMA.
  config.data.dataset = "conditional"  # JSONL prompt/response pairs; only responses are masked.
  config.data.path = ""  # Required: --config.data.path=FILE_OR_FOLDER of the JSONL pairs.
  config.data.tokenizer = "bpe"  # LLaDA's byte-level BPE, read from data.tokenizer_path.
  config.data.tokenizer_path = ""  # Required for a run: the checkpoint's tokenizer.json.
  config.data.vocab_size = LLADA_VOCAB_SIZE  # The checkpoint's embedding rows (mask id: 126464).
  config.data.seq_len = 4096  # LLaDA's context: one prompt + response per row.
  config.model.type = "mdm"  # Bidirectional masked diffusion denoiser.
  config.model.num_layers = 32  # Transformer blocks.
  config.model.model_dim = 4096  # Residual stream width.
  config.model.num_heads = 32  # Attention heads (head dim 128).
  config.model.num_kv_heads = 0  # 0 = num_heads: LLaDA-8B has no grouped-query attention.
  config.model.mlp_dim = 12288  # SwiGLU hidden width.
  config.model.mlp = "swiglu"  # Llama's gated MLP (silu).
  config.model.norm = "rms"  # RMSNorm with a learned scale.
  config.model.norm_eps = 1e-5  # LLaDA's rms_norm_eps.
  config.model.rope_base = 500000.0  # LLaDA's rope_theta.
  config.model.biases = False  # No biases anywhere.
  config.model.qkv_bias = False  # No attention biases either.
  config.model.tie_embeddings = False  # A logits layer of its own (weight_tying false).
  config.model.time_conditioning = "none"  # Time-free: LLaDA's network never reads t.
  config.model.checkpoint_mask_id = (
    126336  # LLaDA's <|mdm_mask|>: never predicted, its row the mask's.
  )
  config.model.dtype = "bfloat16"  # Compute in bfloat16; params and optimizer state stay float32.
  config.model.attention = "splash"  # The TPU kernel: no [4096, 4096] score matrices in HBM.
  config.model.remat = (
    "full"  # Recompute each block in the backward pass: one block's activations live.
  )
  config.model.scan_layers = True  # Blocks under nn.scan: compile time flat in depth.
  config.mesh.data = 1  # No replicated copies: an 8B state does not fit twice.
  config.mesh.fsdp = -1  # Params, AdamW moments and EMA sharded over every chip.
  config.mesh.tensor = 1  # No tensor parallelism: FSDP alone fits a v5p-8, v6e-8 and v5e-16.
  config.optimizer.learning_rate = 2.5e-5  # LLaDA's SFT peak learning rate.
  config.optimizer.warmup_steps = 50  # LLaDA's SFT warmup.
  config.optimizer.weight_decay = 0.1  # LLaDA's SFT weight decay.
  config.optimizer.b2 = 0.95  # Adam second-moment decay usual for LLM fine-tuning.
  config.optimizer.ema_decay = 0.0  # The EMA copies the params: a fine-tune samples its latest.
  config.training.estimator = "standard"  # The masked responses' NELBO, as LLaDA's SFT loss.
  config.eval.num_sequences = 256  # Held-out pairs scored per evaluation.
  config.eval.num_mc_samples = 1  # NELBO draws per pair (an 8B forward pass each).
  config.eval.batch_size = 16  # Rows per evaluation and sampler call (a multiple of the chips).
  config.eval.discrete_steps = ""  # The continuous bound only.
  config.eval.profile_bins = 0  # No per-t loss profile.
  config.sample.num_samples = 8  # Responses generated by --mode=sample.
  config.sample.method = "confidence"  # LLaDA's low-confidence remasking.
  config.sample.confidence = "drawn_prob"  # Its ranking: the drawn token's softmax probability.
  config.sample.reveal_counts = "even"  # Its counts: a block's masks split evenly over its steps.
  config.sample.blocks_after_prompt = True  # Its semi-autoregressive blocks follow the prompt.
  config.sample.temperature = 0.0  # Its default: greedy.
  config.sample.num_steps = 32  # Steps per block: one token per step at block_length 32.
  config.sample.block_length = 32  # LLaDA's semi-autoregressive blocks of 32 tokens.
  config.sample.cache = (
    "dual"  # Fast-dLLM's dual KV cache: a call reads every position outside the block.
  )
  config.sample.trajectory = False  # No trajectory files for 4096-token samples.
  return config
