"""base_config: every key of the config tree, declared once with its meaning.

A config file (md4jax/configs/*.py) overrides values only. Each key is held in a `Declared`
reference that remembers whether anything set it since base_config made it (a config file or a
command-line override: what model.preset may not silently replace, md4jax.config.presets) and
whether a checkpoint fixes it (fixed(...) at its declaration).
"""

import ml_collections
from ml_collections import config_dict

NOTES = ("was_set", "fixed")  # What a Declared key remembers beside its value.


class Declared(config_dict.FieldReference):
  """A key's value: `was_set` once anything assigned it after base_config; `fixed` when a
  checkpoint fixes it."""

  def __init__(self, value, fixed: bool = False):
    self.was_set = False
    super().__init__(value.get() if isinstance(value, Declared) else value)
    self.fixed, self.was_set = fixed or isinstance(value, Declared) and value.fixed, False

  def set(self, value, type_safe=True):
    super().set(value, type_safe)
    self.was_set = True

  def __setstate__(self, state):  # copy.deepcopy and pickle: FieldReference keeps its own only.
    super().__setstate__(state)
    self.was_set, self.fixed = (bool(state[name]) if name in state else False for name in NOTES)


def fixed(value) -> Declared:
  """A key a checkpoint fixes: a resumed run may not change it."""
  return Declared(value, fixed=True)


class Config(ml_collections.ConfigDict):
  """A ConfigDict whose keys are Declared references; `update` takes another such config (whose
  values it reads), as ConfigDict.update takes a plain one."""

  def update(self, *other, **kwargs):
    plain = [o.copy_and_resolve_references() if isinstance(o, Config) else o for o in other]
    super().update(*plain, **kwargs)


def _declared(config: ml_collections.ConfigDict) -> Config:
  """config with every value held in a Declared reference (fixed ones stay fixed)."""

  def declare(node):
    return Config(
      {
        key: declare(value) if isinstance(value, ml_collections.ConfigDict) else Declared(value)
        for key, value in node.items(preserve_field_references=True)
      }
    )

  return declare(config)


def walk(node, prefix: str = ""):
  """(dotted key, its Declared reference or plain value) of every key of a config."""
  for key, value in node.items(preserve_field_references=True):
    if isinstance(value, ml_collections.ConfigDict):
      yield from walk(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def fixed_keys() -> tuple[str, ...]:
  """The dotted keys base_config declares fixed."""
  return tuple(name for name, value in walk(base_config()) if getattr(value, "fixed", False))


def base_config() -> ml_collections.ConfigDict:
  """Every key the trainer reads, with neutral values; configs override them. A key declared
  fixed(value) decides what a checkpoint holds (its params' shapes, its vocabulary, the data
  its data state refers to): a resumed run may not change it (md4jax.config.resume)."""
  # One key a line, its meaning in the trailing comment (docs/configuration.md reads them).
  # fmt: off
  config = ml_collections.ConfigDict()
  config.seed = fixed(0)  # Seeds the params, the per-step RNG and the training data order.
  config.batch_size = 64  # Global batch (sequences per step), split over all devices.
  config.num_train_steps = 1000  # Optimizer steps of the whole run (a resumed run continues to it).
  config.log_every_steps = 100  # Steps between metrics.jsonl records and progress lines.
  config.eval_every_steps = 1000  # Steps between evaluations, each the headline bound only (the other bounds, discrete-T table and profile: the final one, after the last step).
  config.checkpoint_every_steps = 500  # Steps between checkpoints; the last step always saves.
  # Faster CPU steps for memory: the heap grows by a few temporaries' worth first; see
  # md4jax.runtime.allocator (figures: docs/performance.md, "Host memory").
  config.reuse_freed_host_memory = False  # CPU, glibc: one malloc arena that never unmaps, so temporaries reuse pages.
  # A small model's step is hundreds of small ops that 2 cores share poorly; a device per core
  # runs its half of the batch whole (figures: docs/performance.md, "CPU devices").
  config.cpu_devices = 0  # CPU runs: JAX devices the host is split into, for data parallelism over its cores; 0 = one.

  config.data = ml_collections.ConfigDict()
  config.data.dataset = fixed("markov")  # "markov" (generated, exact entropy), "text8", "localtext", "conditional" (JSONL pairs), "lm1b" or "owt".
  config.data.vocab_size = fixed(32)  # Clean token ids [0, vocab_size); the mask id is vocab_size. Text: the tokenizer's size, or 0 to take it from the tokenizer.
  config.data.seq_len = fixed(64)  # Tokens per training and evaluation sequence.
  config.data.language_seed = fixed(0)  # markov: seeds the transition matrix and the evaluation sequences.
  config.data.concentration = fixed(0.3)  # markov: Dirichlet concentration of transition rows (small = predictable).
  config.data.path = fixed("")  # Text datasets: a local file or folder (text8: text8/text8.zip, split 90/5/5).
  config.data.tokenizer = fixed("char")  # localtext, conditional: "char" (data's alphabet + EOS), "byte" (256 + EOS) or "bpe".
  config.data.bpe_vocab_size = fixed(4096)  # "bpe": ids of the BPE trained on the training split (EOS included).
  config.data.tokenizer_path = fixed("")  # A local tokenizer.json instead (lm1b/owt: BERT/GPT-2's); "" trains or fetches one.
  config.data.packing = fixed("concat")  # Text rows: "concat" (random windows of the token stream) or "documents"; conditional: one example per row.
  config.data.text_field = fixed("text")  # JSONL files: the field holding each document's text.
  config.data.prompt_field = fixed("prompt")  # conditional: the JSONL field of the prompt (read, never masked nor scored).
  config.data.response_field = fixed("response")  # conditional: the JSONL field of the response (the model's target).
  config.data.chat_template = fixed("")  # A chat template (Jinja, tokenizer_config.json's, its special tokens bound) that sample.chat renders around sample.prompt; md4jax.convert sets it.
  config.data.worker_count = 0  # grain worker processes for text batches; 0 reads in the training process.

  config.model = ml_collections.ConfigDict()
  config.model.type = fixed("mdm")  # "mdm": bidirectional masked-diffusion denoiser; "ar": causal next-token baseline.
  config.model.num_layers = fixed(2)  # Transformer blocks.
  config.model.model_dim = fixed(64)  # Residual stream width.
  config.model.num_heads = fixed(4)  # Attention heads; model_dim / num_heads must be even (RoPE).
  config.model.mlp_dim = fixed(256)  # Hidden width of the SwiGLU MLP.
  config.model.time_conditioning = fixed("none")  # "none" (time-free denoiser) or "adaln" (adaLN-Zero on alpha(t)); "ar" needs "none".
  config.model.dtype = "float32"  # Compute dtype, "float32" or "bfloat16"; params and optimizer state are always float32.
  config.model.attention = "xla"  # "xla" (any platform), "cudnn" (GPU flash attention, bfloat16) or "splash" (TPU Pallas kernel).
  config.model.remat = "none"  # Recompute block activations in the backward pass: "none", "full" or "save_dots" (keeps weight-matmul outputs).
  config.model.scan_layers = fixed(False)  # Run the blocks under nn.scan (params stacked per layer): compile time flat in depth.
  config.model.norm = fixed("rms")  # "rms" (RMSNorm, learned scale) or "layer" (LayerNorm without scale or bias, as MD4).
  config.model.mlp = fixed("swiglu")  # MLP gate: "swiglu" (silu) or "sigmoid_glu" (sigmoid, as MD4).
  config.model.embed_dim = fixed(0)  # Token embedding width projected to model_dim (MD4: 64); 0 = model_dim, no projection.
  config.model.output_init = "normal"  # Init of the logits layer: "normal" (as model.weight_init's other matrices) or "zeros" (as MD4; pair it with a fan_in weight_init: after normal's it stays at the unigram, docs/md4_parity.md).
  config.model.weight_init = "normal"  # "normal" (std 0.02, residual-stream outputs 0.02/√(2N)), "fan_in" (truncated normal, variance 1/fan_in) or "fan_in_mlp_depth" (MD4: the MLP's at (2/N)/fan_in).
  config.model.norm_eps = fixed(1e-6)  # Epsilon of every norm (MD4: 1e-5).
  config.model.biases = fixed(False)  # Biases on the embedding projection, the time MLP and the adaLN projections (MD4); never on attention (see qkv_bias), MLP or logits.
  config.model.num_kv_heads = fixed(0)  # Key and value heads (grouped-query attention, Llama's and Qwen2's), each read by num_heads / num_kv_heads query heads; 0 = num_heads.
  config.model.qkv_bias = fixed(False)  # A bias on the attention's query, key and value projections (Qwen2's).
  config.model.tie_embeddings = fixed(False)  # Logits read off the token embedding's first vocab_size rows (the mask row is an input only) instead of a logits layer of their own (tie_word_embeddings); needs embed_dim = 0.
  config.model.rope_base = fixed(10000.0)  # RoPE's θ: a head's pair i turns by rope_base^(-2i/head_dim) per position (Llama 3: 500000, Qwen2: 1000000).
  config.model.shifted_prediction = fixed(False)  # mdm: Dream's shift, the network reads [BOS = mask id, z_0, ..., z_{L-2}] so position i's output predicts token i from the positions before it, as an ar model's next-token head does (adapting one: docs/adapt.md).
  config.model.checkpoint_mask_id = fixed(-1)  # A released dLLM's own mask id inside the vocabulary (LLaDA 126336, Dream 151666), set by md4jax.convert: never predicted (logit -inf), its embedding row is the mask's (row vocab_size); -1: none.
  config.model.shift_logits = fixed(False)  # mdm: Dream's shift, position i's logits are the last layer's output at position i − 1 (position 0 keeps its own), the network reading z itself; set by md4jax.convert for a Dream checkpoint (caches: none only).
  config.model.time_input = fixed("alpha")  # adaln: the denoiser's time input, "alpha" (α(t)) or "t" (MD4; the samplers pass t = the schedule's inverse of α).
  config.model.time_features = fixed("dit")  # adaln: sinusoidal time features, "dit" ([cos, sin], 10000^(-i/half)) or "ddpm" ([sin, cos], 10000^(-i/(half-1)), MD4).
  config.model.time_dim = fixed(0)  # adaln: width of the time features and time embedding (MD4: the head dim); 0 = model_dim.
  config.model.time_hidden_dim = fixed(0)  # adaln: hidden width of the time MLP (MD4: 4 × time_dim); 0 = the time embedding's width.
  config.model.adaln_activation = fixed("silu")  # adaln: activation of the time embedding every adaLN projection reads, "silu" or "sigmoid" (MD4).
  config.model.preset = fixed("none")  # "none" or "md4": sets every model choice above to MD4's text network, expanded when the config loads (md4jax.config.presets; docs/md4_parity.md).
  config.model.lora_rank = fixed(0)  # LoRA: rank r of an update W + (lora_alpha / r)·A·B on every attention and MLP projection, and only the adapters train (docs/lora.md); 0 = off, every param trains.
  config.model.lora_alpha = fixed(16.0)  # LoRA: the update is scaled by lora_alpha / lora_rank (PEFT's lora_alpha), > 0.
  config.model.self_condition = fixed(False)  # mdm: self-conditioning (CDCD, DiffusionGemma): the network also reads an estimate of x_0 (half the training steps its own stop-gradient first pass; the bound reads it; uniform samplers pass each step's on), one block, no shift.

  # Device mesh (md4jax.runtime.sharding): data × fsdp × tensor = the device count; one may be -1 (the rest).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # Data parallel: whole params per device group.
  config.mesh.fsdp = 1  # Data parallel with params, optimizer state and EMA sharded on the model dimension.
  config.mesh.tensor = 1  # Tensor parallel: attention heads and MLP width split.

  config.diffusion = ml_collections.ConfigDict()
  config.diffusion.process = "masked"  # Corruption: "masked" (absorbing: a token becomes the mask id) or "uniform" (UDLM/DUO: redrawn uniformly over the vocabulary, and any token may change at any step; docs/math.md § 13): an mdm (in blocks with diffusion.block_size, an adaLN network reading each position's noise level), the standard estimator, sample.method ancestral, greedy_tail or canvas.
  config.diffusion.schedule = "linear"  # Masking schedule alpha(t): linear, cosine, loglinear, geometric, polyK; learned (GenMD4): learned_tokenpoly (alpha_v = 1 - t^w_v, one w per token) or learned_poly (one shared w).
  config.diffusion.exponent_init = 1.0  # Learned schedules: initial exponent w (1 = linear).
  config.diffusion.exponent_learning_rate = 1e-2  # Learned schedules: peak learning rate of theta (w = softplus(theta)), same warmup and decay.
  config.diffusion.exponent_gradient = "rloo"  # Learned schedules: gradient of w through the masks, "rloo" (two draws, leave-one-out baseline) or "score" (no baseline).
  config.diffusion.reconstruction_time = 1e-4  # Learned schedules: epsilon; t < epsilon is one reconstruction step (md4jax.diffusion.genmd4); 0 = none.
  config.diffusion.block_size = 0  # Block diffusion (BD3-LM): blocks of this many tokens, each diffused given the clean blocks before it (dividing data.seq_len; a time-free mdm, or under diffusion.process='uniform' one reading each position's noise level); 0 or seq_len = the whole sequence.
  config.diffusion.endpoint_terms = "sampled"  # Schedules with α(0) < 1 or α(1) > 0: "sampled" (Monte Carlo terms, the exact bound) or "md4" (MD4's constant reconstruction term, no prior term).

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = 1e-3  # Peak learning rate, reached after the warmup.
  config.optimizer.warmup_steps = 100  # Linear warmup from 0; then cosine decay to 0 at num_train_steps.
  config.optimizer.weight_decay = 0.0  # AdamW decoupled decay, on matrices only (not norms, biases).
  config.optimizer.grad_clip_norm = 1.0  # Gradients are rescaled to at most this global norm; 0 = no clipping (MD4).
  config.optimizer.b1 = 0.9  # Adam first-moment decay.
  config.optimizer.b2 = 0.99  # Adam second-moment decay.
  config.optimizer.ema_decay = 0.99  # EMA of params used for eval and sampling, reached after a warm-up (train.ema_decay_at); 0 copies the params.
  config.optimizer.ema_warmup = True  # Warm the EMA decay up from 0.1 (train.ema_decay_at); False: ema_decay from step 0 (MD4).

  config.training = ml_collections.ConfigDict()
  config.training.estimator = "standard"  # NELBO estimator of the loss: standard, forced_target or mask_count.
  config.training.prompt_dropout = 0.0  # Classifier-free guidance: each row's prompt (never scored) is hidden from the mdm with this probability, so it also learns the prompt-free law sample.guidance_scale contrasts; 0 = off.
  config.training.mask_rates = ""  # BD3-LM's clipped schedule: "β,ω" draws each training mask rate uniformly in [β, ω] (lower-variance gradients; not a bound: evaluation scores the full one); "" = [0, 1].
  config.training.loss_units = "nats"  # Unit of the per-token loss whose gradient the optimizer sees: "nats" or "bits" (MD4; the gradient / ln 2).
  config.training.max_checkpoints_to_keep = 3  # Older checkpoints are deleted.
  config.training.grad_accum_steps = 1  # Microbatches per step (gradients summed): the step of the whole batch in less memory.
  config.training.init_from = ""  # A workdir (md4jax-trained or converted) whose newest EMA params start a fresh run at step 0, the EMA at them; its network's param shapes must match (AR → MDM: configs/adapt.py), and its saved tokenizer (of data.tokenizer's kind, else an error) reads this run's text unless data.tokenizer_path names one; a workdir with checkpoints of its own resumes them instead; "" = a random init.
  config.training.attention_anneal_steps = 0  # mdm: DiffuLLaMA's annealing over N steps: at step s query i reads keys j <= i and each later one with probability min(1, s / N) (one draw per pair and step): causal at 0, bidirectional from N on (eval and sampling always); 0 = bidirectional throughout.

  config.eval = ml_collections.ConfigDict()
  config.eval.num_sequences = 256  # Held-out sequences; the standard error is over them.
  config.eval.num_mc_samples = 8  # NELBO draws averaged per sequence (mdm only; ar is exact).
  config.eval.estimator = "mask_count"  # NELBO estimator for eval; mask_count has bounded variance.
  config.eval.batch_size = 64  # Sequences per evaluation call, split over all devices.
  config.eval.discrete_steps = "10,50,1000"  # mdm: T of the discrete-time bounds reported beside the continuous one; "" skips them.
  config.eval.num_discrete_draws = 4  # mdm: NELBO draws per sequence of each discrete-time bound (the continuous ones take num_mc_samples).
  config.eval.judge_workdir = ""  # An md4jax AR workdir on the same data: scores the eval rows and fresh samples (generative perplexity); "" = off.
  config.eval.num_judged_samples = 64  # Fresh samples (sample.* settings) scored by the judge; the SE is over them.
  config.eval.profile_bins = 20  # mdm: bins of t in the per-t loss profile (w(t)·CE, one draw per bin and sequence); 0 skips it.
  config.eval.likelihood = "nelbo"  # mdm, final evaluation: also the exact likelihood over orders (docs/math.md § 5b), "order" (left to right) or "orders:K" (importance-weighted over K random orders, between the NLL and the NELBO; K·L calls per sequence); "nelbo": the bounds only.

  # --mode=frontier: fresh samples at every (method, num_steps, temperature), each
  # scored by the judge (eval.judge_workdir) and by the true law where it is known.
  config.frontier = ml_collections.ConfigDict()
  config.frontier.methods = "ancestral,confidence"  # mdm samplers swept (md4jax.sampling.samplers); ar models decode token by token.
  config.frontier.num_steps = "16,64,256"  # mdm sampler steps swept; ar, first_hitting and threshold ignore them.
  config.frontier.thresholds = "0.5,0.7,0.9,0.99"  # method "threshold": the thresholds swept (each in (0, 1]).
  config.frontier.temperatures = "0.7,0.8,0.9,1.0"  # Softmax temperatures swept (each > 0).
  config.frontier.num_samples = 64  # Samples per point; the standard errors are over them.

  # --mode=post_train (docs/post_training.md): the policy starts at post_train.init_from's EMA
  # params, which stay its frozen reference; rollouts are drawn with sample.*.
  config.post_train = ml_collections.ConfigDict()
  config.post_train.init_from = ""  # The workdir whose newest EMA params start the policy and stay its frozen KL reference (required; the same network shapes; its saved tokenizer, of data.tokenizer's kind, reads the prompts).
  config.post_train.reward = ""  # "bigram:FILE.npy" (a [V, V] table R: a rollout scores Σ R[x_ℓ, x_ℓ+1] over the pairs ending in a generated token), "exact_match" (1 if the generated span is the conditional example's response and EOS, else 0) or "module:function" (a Python callable on the rollouts, a dict of [N, L] arrays tokens, generated, reference, reference_editable -> N finite rewards).
  config.post_train.pairs = ""  # algorithm "vrpo": a JSONL file of {"prompt", "chosen", "rejected"} (batch_size pairs a step); "" otherwise.
  config.post_train.algorithm = "grpo"  # Advantages within each group: "grpo" ((r − mean) / (std + 1e-4)), "dr_grpo" (r − mean) or "rloo" (r − the others' mean); or "vrpo": DPO on post_train.pairs with VRPO's shared draws (β: DPO's).
  config.post_train.beta = 0.0  # β >= 0 of E[r] − β KL(π ‖ π_ref): the estimated log-ratio enters the reward (docs/post_training.md); 0 = no KL.
  config.post_train.group_size = 8  # Rollouts per prompt (>= 2), whose rewards are compared: a step reads batch_size prompts (data rows) and draws batch_size × group_size rollouts.
  config.post_train.updates_per_rollout = 1  # Optimizer steps on each batch of rollouts (GRPO's μ); past the first, the clipped ratio bounds each.
  config.post_train.clip = 0.2  # PPO's ε > 0: the ratio π / π_rollout is clipped to [1 − ε, 1 + ε] against the advantage.
  config.post_train.likelihood = "nelbo"  # The log π estimate (md4jax.diffusion.log_likelihood): "nelbo" (mask-count draws), "d1" (one step) or "coupled" (complementary masks).
  config.post_train.likelihood_draws = 1  # Draws K of the nelbo and coupled estimates (K and 2K network calls).
  config.post_train.prompt_mask_prob = 0.15  # likelihood "d1": each prompt position is masked with this probability, in [0, 1).

  # --mode=distill (docs/distillation.md): a few-step student, SDTT's of a masked model or DCD's of
  # a uniform-state one, in rounds of num_train_steps / distill.rounds steps, each halving the
  # sampler's steps.
  config.distill = ml_collections.ConfigDict()
  config.distill.init_from = ""  # The workdir whose newest EMA params start the student (required; the same network shapes; its saved tokenizer, of data.tokenizer's kind, reads text), and with distill.teacher "" its first teacher.
  config.distill.teacher = ""  # The first round's teacher: "" (init_from's network: self-distillation) or "oracle" (the exact denoiser of data.dataset markov's language, of the run's diffusion.process); each later round's is the round before's student.
  config.distill.teacher_steps = 64  # The first teacher's ancestral steps T: round r's student (from 1) learns two teacher steps in one, T / 2^r steps; 2^rounds must divide it.
  config.distill.rounds = 4  # Rounds, each num_train_steps / rounds optimizer steps (dividing it): the last student samples in teacher_steps / 2^rounds steps.
  config.distill.divergence = "reverse_kl"  # The student's loss at each scored position (SDTT: the masked ones; DCD: every editable one): "reverse_kl" (KL(student ‖ teacher), SDTT's default) or "forward_kl" (KL(teacher ‖ student)).

  config.sample = ml_collections.ConfigDict()
  config.sample.num_samples = 4  # Sequences generated at the end of training and by --mode=sample.
  config.sample.num_steps = 64  # Time-grid steps of the mdm sampler (first_hitting and ar take seq_len calls).
  config.sample.method = "ancestral"  # mdm sampler: ancestral, cached, jump, first_hitting, confidence, threshold or remdm (md4jax.sampling.samplers).
  config.sample.confidence = "max_prob"  # method "confidence": what ranks the masked positions, "max_prob", "margin" (top-1 − top-2), "neg_entropy", "drawn_prob" (LLaDA's: the drawn token's softmax prob) or "drawn_filtered_prob" (Dream's maskgit_plus above temperature 0).
  config.sample.reveal_counts = "schedule"  # method "confidence": how many each step reveals, "schedule" (all but the schedule's share), "even" (LLaDA's: the block's masks split evenly, the remainder first) or "proportional" (Dream's: int(n · (1 − s/t)) of the n left).
  config.sample.blocks_after_prompt = False  # mdm: sample.block_length's blocks start after sample.prompt (LLaDA's semi-autoregressive decoding, Fast-dLLM's) instead of at position 0 (without a prompt: from 0).
  config.sample.threshold = 0.9  # method "threshold": reveal every masked position whose top probability is >= this, in [0, 1] (0: all in one call).
  config.sample.remask = "cap"  # method "remdm": σ_t of remasking, "cap" (min(η, σ_max)), "rescale" (η σ_max) or "confidence" (σ_max shared by the least confident tokens; η unused).
  config.sample.remask_eta = 0.0  # method "remdm": η in [0, 1]; 0 with cap or rescale is ancestral, token for token.
  config.sample.remask_loop = 0  # method "remdm": ReMDM-loop's extra steps at a fixed α (then only they remask); 0 = none.
  config.sample.remask_loop_alpha = 0.9  # method "remdm": the loop runs once the grid reaches α >= this, in (0, 1).
  config.sample.guidance_scale = 0.0  # Classifier-free guidance w >= 0 (needs sample.prompt): (1 + w) cond − w uncond log-probs, uncond with the prompt masked; 0 = off.
  config.sample.temperature = 1.0  # Softmax temperature of every draw; 1 samples the model, 0 is greedy.
  config.sample.top_k = 0  # Keep only the k most likely tokens of every draw; 0 keeps all.
  config.sample.top_p = 1.0  # Nucleus: keep the smallest set of tokens with this much probability; 1 keeps all.
  config.sample.prompt = ""  # Text every sample starts with (markov: space-separated ids); "" starts from all-mask.
  config.sample.chat = False  # Render sample.prompt as a user's message in data.chat_template (an Instruct model's form) before encoding it.
  config.sample.length = 0  # Tokens per sample; 0 = data.seq_len. Longer (mdm): generated block by block.
  config.sample.block_length = 0  # New tokens per window when length > seq_len (mdm); 0 = seq_len // 2. With sample.cache: the decoding block.
  config.sample.cache = "none"  # Fast-dLLM's approximate KV cache, "prefix" or "dual": decode block by block within the context (sample.block_length, dividing the length, or with sample.blocks_after_prompt the length after the prompt; time-free mdm); "none" = off.
  config.sample.trajectory = True  # Write trajectory.html and .gif of the first sample (masked-process mdm without blocks, length <= seq_len).
  # fmt: on
  return _declared(config)
