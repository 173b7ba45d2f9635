r"""Dream-v0-7B's shape (Dream-org/Dream-v0-Base-7B and -Instruct-7B, Qwen2.5-7B's network):
supervised fine-tuning on prompt/response pairs, at the size of the released checkpoints. A
time-free masked diffusion LM: 28 Qwen2 blocks of width 3584, 28 query heads reading 4 key and
value heads, biases on the query, key and value projections, SwiGLU MLP 18944, RMSNorm eps 1e-6,
RoPE θ 1000000, vocabulary 152064, untied embeddings, 4096 tokens. (Dream's shifted prediction
changes which position predicts which token, not a parameter's or an activation's shape.)

Whether it fits a TPU slice, on any CPU machine (pip install -e ".[tpu]"; the measured table and
its commands: docs/scaling.md, "LLaDA-8B and Dream-7B"):

  JAX_PLATFORMS=cpu python -m md4jax.aot --config=configs/dream.py --topology=v6e:2x4

The mesh and remat here fit full SFT at 16 x 4096 tokens on a v5p-8 (4 chips of 95 GiB, 53 GiB used
per chip), a v6e-8 (8 chips of 32 GiB, 27 GiB used) and a v5e-16 (16 chips of 16 GiB, 14.1 GiB used,
of the 15.75 GiB libtpu allows): float32 params, AdamW moments and EMA take 16 bytes a parameter,
122 GB for 7.6B parameters, sharded over every chip (FSDP). Sampling (8 rows, with or without the
dual cache) fits all three (docs/scaling.md).

SFT of a converted checkpoint (docs/convert.md) on prompt/response JSONL, only the responses
masked and scored. Text data needs data.vocab_size to be the tokenizer's number of ids T (the mask
input is id T), and the released embedding has 152064 rows, more than T: convert with
--vocab_size=T (md4jax.convert refuses text data without it and prints T) and give the run the
same T, or training.init_from's params do not fit the preset's 152064 rows:

  python -m md4jax.convert --in=/mnt/shared/Dream-v0-Instruct-7B \
      --out=/mnt/shared/dream-v0-instruct-7b --config=configs/conditional.py \
      --config.data.path=/mnt/shared/pairs.jsonl --vocab_size=T
  python -m md4jax.main --config=configs/dream.py --workdir=/mnt/shared/dream-sft \
      --config.training.init_from=/mnt/shared/dream-v0-instruct-7b \
      --config.data.vocab_size=T \
      --config.data.path=/mnt/shared/pairs.jsonl \
      --config.data.tokenizer_path=/mnt/shared/dream-v0-instruct-7b/tokenizer.json

Sampling (--mode=sample) takes Dream's maskgit_plus ranking and proportional reveal counts over the
whole sample as one block, with as many steps as tokens to generate, as Dream's README does
(max_new_tokens=512, steps=512): one token a step.
"""

from md4jax import config as config_lib

# The released checkpoints' embedding rows (vocab_size in their config.json), padded past the
# tokenizer's ids. Qwen2.5's tokenizer has 151665 (0-151664); Dream's mask token <|mask|> is
# 151666 (config.json's mask_token_id), a tokenizer id (md4jax.convert checks it), so Dream's
# tokenizer has at least 151667 ids, fewer than the rows. A run on text sets data.vocab_size to
# the tokenizer's count (the module docstring); md4jax's mask input is id data.vocab_size.
DREAM_VOCAB_SIZE = 152064


def get_config():
  config = config_lib.base_config()
  config.batch_size = 16  # Global batch: 16 rows of 4096 tokens (4 per v5p chip, 1 per v5e).
  config.num_train_steps = 2000  # A fine-tune's length.
  config.log_every_steps = 10  # A 7B step takes seconds: log often.
  config.eval_every_steps = 500  # Evaluate the held-out responses' NELBO every 500 steps.
  config.checkpoint_every_steps = 250  # A checkpoint holds 7.6B float32 params, moments and EMA.
  config.data.dataset = "conditional"  # JSONL prompt/response pairs; only responses are masked.
  config.data.path = ""  # Required: --config.data.path=FILE_OR_FOLDER of the JSONL pairs.
  config.data.tokenizer = "bpe"  # Qwen2's byte-level BPE, read from data.tokenizer_path.
  config.data.tokenizer_path = ""  # Required for a run: the checkpoint's tokenizer.json.
  config.data.vocab_size = DREAM_VOCAB_SIZE  # The checkpoint's embedding rows.
  config.data.seq_len = 4096  # Tokens per row: one prompt + response.
  config.model.type = "mdm"  # Bidirectional masked diffusion denoiser.
  config.model.num_layers = 28  # Transformer blocks.
  config.model.model_dim = 3584  # Residual stream width.
  config.model.num_heads = 28  # Query heads (head dim 128).
  config.model.num_kv_heads = 4  # Key and value heads: grouped-query attention, 7 queries each.
  config.model.mlp_dim = 18944  # SwiGLU hidden width.
  config.model.mlp = "swiglu"  # Qwen2's gated MLP (silu).
  config.model.norm = "rms"  # RMSNorm with a learned scale.
  config.model.norm_eps = 1e-6  # Qwen2.5's rms_norm_eps.
  config.model.rope_base = 1000000.0  # Qwen2.5's rope_theta.
  config.model.biases = False  # No biases but the attention's.
  config.model.qkv_bias = True  # Qwen2's query, key and value biases.
  config.model.tie_embeddings = False  # A logits layer of its own (tie_word_embeddings false).
  config.model.time_conditioning = "none"  # Time-free: Dream's network never reads t.
  config.model.checkpoint_mask_id = 151666  # Dream's <|mask|>: never predicted, its row the mask's.
  config.model.shift_logits = True  # Dream's shift: position i's logits come from position i - 1.
  config.model.dtype = "bfloat16"  # Compute in bfloat16; params and optimizer state stay float32.
  config.model.attention = "splash"  # The TPU kernel: no [4096, 4096] score matrices in HBM.
  config.model.remat = (
    "full"  # Recompute each block in the backward pass: one block's activations live.
  )
  config.model.scan_layers = True  # Blocks under nn.scan: compile time flat in depth.
  config.mesh.data = 1  # No replicated copies: a 7B state does not fit twice.
  config.mesh.fsdp = -1  # Params, AdamW moments and EMA sharded over every chip.
  config.mesh.tensor = 1  # No tensor parallelism: FSDP alone fits a v5p-8, v6e-8 and v5e-16.
  config.optimizer.learning_rate = 1e-5  # A full fine-tune's peak learning rate.
  config.optimizer.warmup_steps = 50  # Linear warmup steps.
  config.optimizer.weight_decay = 0.1  # AdamW decay on matrices.
  config.optimizer.b2 = 0.95  # Adam second-moment decay usual for LLM fine-tuning.
  config.optimizer.ema_decay = 0.0  # The EMA copies the params: a fine-tune samples its latest.
  config.training.estimator = "standard"  # The masked responses' NELBO.
  config.eval.num_sequences = 256  # Held-out pairs scored per evaluation.
  config.eval.num_mc_samples = 1  # NELBO draws per pair (a 7B forward pass each).
  config.eval.batch_size = 16  # Rows per evaluation and sampler call (a multiple of the chips).
  config.eval.discrete_steps = ""  # The continuous bound only.
  config.eval.profile_bins = 0  # No per-t loss profile.
  config.sample.num_samples = 8  # Responses generated by --mode=sample.
  config.sample.method = "confidence"  # Dream's maskgit_plus: the most confident positions first.
  config.sample.confidence = "drawn_filtered_prob"  # maskgit_plus: the drawn token's probability.
  config.sample.reveal_counts = "proportional"  # Dream's counts: int(n (1 - s/t)) of the n left.
  # Dream's default decoding: steps = new tokens. A sample of 512 tokens is one block (cache "none",
  # no blocks_after_prompt), so 512 steps reveal one token a step from an all-mask start (the
  # proportional counts reveal none on the first step and two on the last, as Dream's do). A
  # prompt of P tokens is part of the 512; for Dream's max_new_tokens = N, steps = N, set
  # sample.length = P + N and sample.num_steps = N.
  config.sample.length = 512  # Tokens per sample, prompt included (0 would be the 4096 context).
  config.sample.num_steps = 512  # Steps of the one block: one token a step (above).
  # Unused by these defaults: the decoding block of sample.cache "prefix" or "dual" (docs/scaling.md
  # prices Dream's shape with them), and the window step of a sample.length past the context.
  config.sample.block_length = 32
  # No KV cache: a cached call runs a block alone, and Dream's shifted logits need the position
  # before it (docs/scaling.md's dual rows for Dream are its shape's cost, not a supported path).
  config.sample.cache = "none"
  config.sample.trajectory = False  # No trajectory files for a 7B's 512-step samples.
  return config
