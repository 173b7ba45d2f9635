"""Configs: every file builds and validates; bad values fail with a message naming the key."""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.app import generate
from md4jax.evaluation import likelihoods
from md4jax.sampling import decoder
from md4jax.training import objective
from md4jax.training import state as state_lib

CONFIG_DIR = config_lib.CONFIG_DIR
CONFIG_NAMES = (
  "default",
  "default:bd3",
  "default:uniform",
  "default:uniform_bd3",
  "distill",
  "distill:uniform",
  "post_train",
  "tiny",
  "tiny_ar",
  "text8",
  "text8:cpu",
  "text8:cpu_bd3",
  "owt",
  "owt:medium",
  "owt:bd3",
  "lm1b",
)


def load(name):
  config = config_lib.load_config(name)
  config.lock()  # As config_flags does: typos fail.
  return config


PLATFORMS = {"owt:bd3": "tpu"}  # Configs for one platform (its attention kernel); else any.


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_validates_and_documents_its_command(name):
  config = load(name)
  config_lib.validate_config(config, num_devices=1, platform=PLATFORMS.get(name, "cpu"))
  file_name, _, variant = name.partition(":")
  command = f"--config=configs/{file_name}.py" + (f":{variant}" if variant else "")
  assert command in (CONFIG_DIR / f"{file_name}.py").read_text()
  assert set(config.keys()) == set(config_lib.base_config().keys())  # No dead or missing keys.


@pytest.mark.parametrize("name", ["localtext", "conditional"])
def test_text_config_validates_once_given_a_path(name):
  config = load(name)
  with pytest.raises(ValueError, match="data.path"):
    config_lib.validate_config(config, num_devices=1)
  config.data.path = "corpus.jsonl"
  config_lib.validate_config(config, num_devices=1)
  assert f"--config=configs/{name}.py" in (CONFIG_DIR / f"{name}.py").read_text()
  assert config.keys() == config_lib.base_config().keys()
  assert config.data.keys() == config_lib.base_config().data.keys()


def test_required_top_level_keys():
  config = config_lib.base_config()
  for key in (
    "num_train_steps",
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "seed",
    "batch_size",
  ):
    assert key in config


def test_every_key_is_commented():
  source = pathlib.Path(inspect.getsourcefile(config_lib.base_config)).read_text()
  assignments = re.findall(r"^\s+config\.[\w.]+ = (?!ml_collections).*$", source, re.MULTILINE)
  assert len(assignments) > 30
  undocumented = [line.strip() for line in assignments if "  # " not in line]
  assert not undocumented, f"config keys without a comment: {undocumented}"


def test_text8_has_paper_settings():
  config = load("text8")
  assert (
    config.data.seq_len,
    config.model.num_layers,
    config.model.model_dim,
    config.model.num_heads,
  ) == (256, 12, 768, 12)
  assert config.diffusion.schedule == "linear"
  assert (
    config.optimizer.learning_rate,
    config.batch_size,
    config.optimizer.warmup_steps,
    config.optimizer.ema_decay,
    config.num_train_steps,
  ) == (3e-4, 512, 2000, 0.9999, 1_000_000)


def test_owt_and_lm1b_have_paper_settings():
  owt, medium, lm1b = load("owt"), load("owt:medium"), load("lm1b")
  assert (owt.data.seq_len, owt.data.vocab_size, owt.batch_size) == (1024, 50257, 512)
  assert (owt.model.num_layers, owt.model.model_dim, owt.model.num_heads) == (12, 768, 12)
  assert (medium.model.num_layers, medium.model.model_dim, medium.model.num_heads) == (24, 1024, 16)
  assert (
    owt.optimizer.learning_rate,
    owt.optimizer.warmup_steps,
    owt.optimizer.b2,
    owt.optimizer.ema_decay,
    owt.num_train_steps,
  ) == (3e-4, 2000, 0.999, 0.9999, 1_000_000)
  assert (lm1b.data.seq_len, lm1b.data.vocab_size, lm1b.batch_size) == (128, 30522, 512)
  assert lm1b.diffusion.schedule == "loglinear" and lm1b.data.dataset == "lm1b"
  for config in (
    owt,
    medium,
    lm1b,
  ):  # Pod settings: FSDP over every chip, bfloat16, scanned blocks.
    assert (config.mesh.data, config.mesh.fsdp, config.model.dtype, config.model.scan_layers) == (
      1,
      -1,
      "bfloat16",
      True,
    )


def test_locked_config_rejects_typos():
  config = load("tiny")
  with pytest.raises(AttributeError):
    config.num_train_step = 5


def _bad(name="tiny", num_devices=1, **overrides):
  config = load(name)
  for key, value in overrides.items():
    *parents, leaf = key.split("__")
    target = config
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return lambda: config_lib.validate_config(config, num_devices=num_devices)


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(diffusion__schedule="cosyne"), r"diffusion.schedule.*Unknown schedule 'cosyne'"),
    (dict(num_train_steps=-5), r"num_train_steps must be a positive integer, got -5"),
    (dict(log_every_steps=0), r"log_every_steps must be a positive integer"),
    (dict(checkpoint_every_steps=-1), r"checkpoint_every_steps must be a positive integer"),
    (dict(model__type="rnn"), r"model.type='rnn' is unknown; valid: mdm, ar"),
    (dict(model__time_conditioning="film"), r"model.time_conditioning='film' is unknown"),
    (dict(model__dtype="float16"), r"model.dtype='float16' is unknown"),
    (dict(training__estimator="importance"), r"training.estimator='importance' is unknown"),
    (dict(eval__estimator="exact"), r"eval.estimator='exact' is unknown"),
    (dict(eval__discrete_steps="10,0"), r"eval.discrete_steps must be distinct positive integers"),
    (
      dict(eval__discrete_steps="10,ten"),
      r"eval.discrete_steps must be distinct positive integers",
    ),
    (dict(eval__discrete_steps="50,50"), r"eval.discrete_steps must be distinct positive integers"),
    (
      dict(optimizer__warmup_steps=20),
      r"optimizer.warmup_steps must be an integer in \[0, num_train_steps=20\)",
    ),
    (dict(optimizer__ema_decay=1.0), r"optimizer.ema_decay must be in \[0, 1\)"),
    (dict(optimizer__learning_rate=0.0), r"optimizer.learning_rate must be > 0"),
    (
      dict(model__num_heads=3),
      r"model.model_dim=32 / model.num_heads=3 must be an even integer head dim",
    ),
    (dict(sample__method="beam"), r"sample.method='beam' is unknown"),
    (dict(data__dataset="wikitext"), r"data.dataset='wikitext' is unknown; valid: markov, text8"),
    (dict(data__dataset="localtext"), r"data.path must name a local file or folder"),
    (
      dict(data__dataset="localtext", data__path="x", data__packing="ragged"),
      r"data.packing='ragged' is unknown",
    ),
    (
      dict(data__dataset="conditional", data__path="x", data__response_field="prompt"),
      r"data.prompt_field and data.response_field are both 'prompt'",
    ),
    (
      dict(data__dataset="conditional", data__path="x", data__prompt_field=""),
      r"data.prompt_field must name a JSONL field",
    ),
    (dict(sample__top_p=0.0), r"sample.top_p must be in \(0, 1\]"),
    (dict(eval__profile_bins=-1), r"eval.profile_bins must be an integer >= 0"),
    (dict(frontier__methods="ancestral,beam"), r"frontier.methods must be distinct samplers"),
    (dict(frontier__methods=""), r"frontier.methods must be distinct samplers"),
    (dict(frontier__num_steps="8,0"), r"frontier.num_steps must be distinct positive integers"),
    (
      dict(frontier__temperatures="1,0"),
      r"frontier.temperatures must be distinct temperatures > 0",
    ),
    (
      dict(frontier__temperatures="1,hot"),
      r"frontier.temperatures must be distinct temperatures > 0",
    ),
    (dict(frontier__num_samples=1), r"frontier.num_samples must be an integer >= 2"),
    (dict(eval__num_judged_samples=1), r"eval.num_judged_samples must be an integer >= 2"),
    (dict(eval__profile_bins=True), r"eval.profile_bins must be an integer >= 0"),
    (dict(sample__block_length=99), r"sample.block_length=99 exceeds data.seq_len"),
    (dict(cpu_devices=-2), r"cpu_devices must be an integer >= 0 \(0 = one device\), got -2"),
    (dict(diffusion__block_size=5), r"diffusion.block_size=5 must be 0 or divide data.seq_len=16"),
    (dict(sample__cache="triple"), r"sample.cache='triple' is unknown"),
    (
      dict(sample__length=40, sample__block_length=3),
      r"sample.length=40 > data.seq_len=16 samples blocks .* which the block length must divide",
    ),
    (dict(training__mask_rates="0.5,0.2"), r"training.mask_rates must be \"\" or \"β,ω\""),
    (dict(training__mask_rates="low"), r"training.mask_rates must be"),
    (
      dict(training__mask_rates="0.2,0.8", training__estimator="mask_count"),
      r"training.mask_rates clips the standard estimator",
    ),
    (
      dict(sample__cache="prefix"),
      r"the length 16 \(sample.length or data.seq_len\) must be <= data.seq_len and divisible",
    ),
    (
      dict(sample__cache="dual", sample__block_length=4, model__time_conditioning="adaln"),
      r"sample.cache='dual' serves a time-free bidirectional mdm",
    ),
    (
      dict(diffusion__block_size=4, model__time_conditioning="adaln"),
      r"diffusion.block_size=4 \(block diffusion\) needs model.time_conditioning='none'",
    ),
    (
      dict(diffusion__block_size=4, training__estimator="mask_count"),
      r"needs training.estimator='standard', got 'mask_count'",
    ),
    (
      dict(diffusion__block_size=4, diffusion__schedule="md4linear"),
      r"schedule 'md4linear' needs endpoint terms; .*diffusion.endpoint_terms='md4'",
    ),
    (dict(cpu_devices=True), r"cpu_devices must be an integer >= 0"),
    (dict(eval__likelihood="orders:0"), r'eval.likelihood must be "nelbo", "order" or "orders:K"'),
    (dict(eval__likelihood="ordres:4"), r"eval.likelihood must be .*got 'ordres:4'"),
    (
      dict(eval__likelihood="order", model__type="ar"),
      r"eval.likelihood='order' scores a masked diffusion model's orders",
    ),
    (
      dict(eval__likelihood="orders:4", diffusion__block_size=4),
      r"eval.likelihood='orders:4': block diffusion \(diffusion.block_size=4\)",
    ),
    (
      dict(
        eval__likelihood="orders:2",
        diffusion__schedule="learned_poly",
        model__time_conditioning="adaln",
        eval__estimator="standard",
        frontier__methods="ancestral",
      ),
      r"eval.likelihood='orders:2': a learned schedule's posterior depends on t",
    ),
  ],
)
def test_bad_values_raise_clear_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    _bad(**overrides)()


@pytest.mark.parametrize(
  "likelihood, parsed",
  [("nelbo", ("nelbo", 0)), ("order", ("order", 1)), ("orders:16", ("orders", 16))],
)
def test_every_likelihood_validates(likelihood, parsed):
  config = load("tiny")
  config.eval.likelihood = likelihood
  config_lib.validate_config(config, num_devices=1)
  assert likelihoods.parse_likelihood(likelihood) == parsed


@pytest.mark.parametrize(
  "overrides",
  [dict(diffusion__block_size=4), dict(sample__cache="prefix", sample__block_length=4)],
  ids=["block_diffusion", "prefix_cache"],
)
def test_guidance_validates_and_samples_with_blocks_and_caches(overrides):
  config = load("tiny")
  for key, value in overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  config.sample.guidance_scale, config.sample.prompt = 1.5, "1 2"
  config_lib.validate_config(config, num_devices=1)
  model = state_lib.build_model(config)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
  how = generate.decoding(config, model, config.data.seq_len)
  assert (how["block_size"], how["cache"]) == (4, "exact" if model.block_size else "prefix")
  tokens, info = decoder.sample(
    jax.random.PRNGKey(1),
    objective.sampling_denoiser(model, params, config),
    batch_size=2,
    length=16,
    prompt=np.asarray([1, 2]),
    **dict(generate.sampler_kwargs(config, params), **how),
  )
  assert np.all(np.asarray(tokens)[:, :2] == [1, 2]) and int(info["num_blocks"]) == 4


def test_blocks_after_a_prompt_validate_without_the_prompts_width():
  """configs/llada.py's decoding (blocks after the prompt, a cache): the length after the prompt
  is whole blocks, which validation cannot see; it must not ask the whole length to be."""
  overrides = dict(sample__cache="dual", sample__block_length=4, sample__length=14)
  _bad(sample__blocks_after_prompt=True, sample__prompt="1 2", **overrides)()
  with pytest.raises(ValueError, match=r"the length 14 \(sample.length or data.seq_len\)"):
    _bad(sample__prompt="1 2", **overrides)()  # Blocks from position 0: whole blocks of 14.


def test_decoding_starts_the_blocks_after_the_prompt_for_every_caller():
  config = load("tiny")
  config.sample.update(blocks_after_prompt=True, block_length=4, length=14, prompt="1 2")
  model = state_lib.build_model(config)
  how = generate.decoding(config, model, 14, 6)
  assert (how["block_offset"], how["block_size"], how["cache"]) == (6, 4, "none")
  assert "block_offset" not in generate.decoding(config, model, 14)  # No prompt: from 0.
  with pytest.raises(ValueError, match="the 10 tokens after the 6-token prompt are no whole"):
    generate.decoding(config, model, 16, 6)
  config.sample.cache = "dual"
  assert generate.decoding(config, model, 14, 6)["block_offset"] == 6
  with pytest.raises(ValueError, match="the 14 tokens after the 0-token prompt are no whole"):
    generate.decoding(config, model, 14)  # The caches decode whole blocks.
  config.sample.blocks_after_prompt = False
  assert "block_offset" not in generate.decoding(config, model, 16, 6)


def test_records_keep_the_blocks_and_the_chat_rendering():
  config = load("tiny")
  plain = generate.settings(config)
  assert not {"blocks_after_prompt", "block_length", "chat", "cache"} & set(plain)
  config.sample.update(blocks_after_prompt=True, block_length=4, prompt="1 2")
  assert generate.settings(config) == dict(
    plain, prompt="1 2", blocks_after_prompt=True, block_length=4
  )
  config.sample.update(blocks_after_prompt=False, block_length=0, length=40)  # Windows.
  assert generate.settings(config) == dict(plain, prompt="1 2", length=40, block_length=8)
  config.sample.update(length=0, cache="prefix", block_length=4, blocks_after_prompt=True)
  config.data.chat_template = "{{ messages[0]['content'] }}"
  config.sample.chat = True
  run = generate.settings(config)
  assert (run["cache"], run["block_length"], run["blocks_after_prompt"], run["chat"]) == (
    "prefix",
    4,
    True,
    True,
  )


def test_shifted_logits_need_a_window_larger_than_the_block():
  """Dream's shift takes a block's first logits from the position before it: a window of
  data.seq_len that is one block leaves it out; the caches run a block alone."""
  shifted = dict(model__shift_logits=True, sample__length=40)
  with pytest.raises(ValueError, match=r"model.shift_logits takes a block's first logits") as e:
    _bad(sample__block_length=16, **shifted)()
  assert "sample.block_length=16" in str(e.value) and "\n" not in str(e.value)
  _bad(sample__block_length=8, **shifted)()
  with pytest.raises(ValueError, match=r"model.shift_logits.*sample.cache='dual'") as e:
    _bad(model__shift_logits=True, sample__cache="dual", sample__block_length=4)()
  assert "\n" not in str(e.value)


def test_batch_not_divisible_by_devices():
  with pytest.raises(
    ValueError,
    match=r"batch_size=12 must split into training.grad_accum_steps=1 "
    r"microbatches of rows divisible by mesh.data × mesh.fsdp = 8",
  ):
    _bad(batch_size=12, num_devices=8)()
  with pytest.raises(
    ValueError, match=r"eval.batch_size=20 is not divisible by mesh.data × mesh.fsdp = 8"
  ):
    _bad(eval__batch_size=20, num_devices=8)()
  with pytest.raises(ValueError, match=r"grad_accum_steps=3 microbatches"):
    _bad(training__grad_accum_steps=3)()


@pytest.mark.parametrize(
  "overrides, num_devices, match",
  [
    (dict(mesh__data=-1, mesh__fsdp=-1), 8, r"at most one may be -1"),
    (dict(mesh__data=0), 8, r"mesh.data must be a positive integer or -1"),
    (dict(mesh__data=3, mesh__fsdp=-1), 8, r"cannot fill 8 devices: 8 is not divisible by 3"),
    (dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=1), 8, r"= 4, but there are 8 devices"),
    (
      dict(mesh__data=1, mesh__fsdp=-1, model__model_dim=36, model__num_heads=2),
      8,
      r"model.model_dim=36 is not divisible by mesh.fsdp=8",
    ),
    (
      dict(mesh__data=-1, mesh__tensor=4),
      8,
      r"model.num_heads=2 is not divisible by mesh.tensor=4",
    ),
    (dict(training__grad_accum_steps=0), 1, r"training.grad_accum_steps must be an integer >= 1"),
    (
      dict(model__attention="flash"),
      1,
      r"model.attention='flash' is unknown; valid: xla, cudnn, splash",
    ),
    (dict(model__remat="some"), 1, r"model.remat='some' is unknown; valid: none, full, save_dots"),
    (dict(model__norm="batch"), 1, r"model.norm='batch' is unknown; valid: rms, layer"),
    (dict(model__mlp="relu"), 1, r"model.mlp='relu' is unknown; valid: swiglu, sigmoid_glu"),
    (dict(model__embed_dim=-1), 1, r"model.embed_dim must be an integer >= 0"),
    (
      dict(model__output_init="ones"),
      1,
      r"model.output_init='ones' is unknown; valid: normal, zeros",
    ),
    (
      dict(sample__method="jump", model__time_conditioning="adaln"),
      1,
      r"sample.method='jump' reuses logits across steps, so it needs a time-free denoiser",
    ),
    (dict(sample__threshold=1.5), 1, r"sample.threshold must be in \[0, 1\]"),
    (
      dict(sample__method="remdm", sample__remask="always"),
      1,
      r"sample.remask='always' is unknown",
    ),
    (dict(sample__remask_eta=2.0), 1, r"sample.remask_eta must be in \[0, 1\]"),
    (
      dict(sample__guidance_scale=1.0),
      1,
      r"sample.guidance_scale needs a prompt \(sample.prompt\)",
    ),
    (dict(frontier__thresholds="0.5,2"), 1, r"frontier.thresholds must be"),
    (dict(model__attention="splash"), 1, r"'splash' is a TPU kernel; this run's devices are 'cpu'"),
    (
      dict(model__attention="cudnn"),
      1,
      r"'cudnn' runs on NVIDIA GPUs only; this run's devices are 'cpu'",
    ),
  ],
)
def test_bad_mesh_and_parallelism_raise_clear_errors(overrides, num_devices, match):
  with pytest.raises(ValueError, match=match):
    _bad(num_devices=num_devices, **overrides)()


def test_platform_specific_attention_validates_where_it_runs():
  splash = load("tiny")
  splash.model.attention, splash.data.seq_len = "splash", 128
  config_lib.validate_config(splash, 1, platform="tpu")
  splash.data.seq_len = 100
  with pytest.raises(ValueError, match=r"'splash' needs data.seq_len divisible by 128, got 100"):
    config_lib.validate_config(splash, 1, platform="tpu")
  cudnn = load("tiny")
  cudnn.model.attention = "cudnn"
  with pytest.raises(ValueError, match=r"'cudnn' \(flash attention\) needs model.dtype='bfloat16'"):
    config_lib.validate_config(cudnn, 1, platform="gpu")
  cudnn.model.dtype = "bfloat16"
  config_lib.validate_config(cudnn, 1, platform="gpu")


def test_vocab_mask_mismatch():
  # text8 has 27 ids; vocab_size 26 would make the mask id 26 collide with the space character.
  with pytest.raises(
    ValueError, match=r"data.vocab_size=26 does not match text8's 27 ids.*mask id"
  ):
    _bad("text8", data__vocab_size=26)()


def test_ar_model_rejects_time_conditioning():
  with pytest.raises(ValueError, match=r"time_conditioning must be 'none' for model.type='ar'"):
    _bad("tiny_ar", model__time_conditioning="adaln")()


def test_cached_sampler_needs_a_time_free_denoiser():
  with pytest.raises(ValueError, match=r"sample.method='cached'.*time-free denoiser"):
    _bad(sample__method="cached", model__time_conditioning="adaln")()


@pytest.mark.parametrize(
  "overrides, match",
  [
    (
      dict(model__weight_init="xavier"),
      r"model.weight_init='xavier' is unknown; valid: normal, fan_in",
    ),
    (dict(model__time_input="sigma"), r"model.time_input='sigma' is unknown; valid: alpha, t"),
    (dict(model__time_features="vdm"), r"model.time_features='vdm' is unknown; valid: dit, ddpm"),
    (dict(model__adaln_activation="gelu"), r"model.adaln_activation='gelu' is unknown"),
    (dict(model__norm_eps=0.0), r"model.norm_eps must be a float > 0"),
    (dict(model__time_dim=-1), r"model.time_dim must be an integer >= 0"),
    (
      dict(model__time_features="ddpm", model__time_dim=2),
      r"time_features='ddpm' needs a time width",
    ),
    (dict(model__preset="gpt2"), r"model.preset='gpt2' is unknown; valid: none, md4"),
    (
      dict(model__preset="md4"),
      r"model.preset='md4' sets model.time_conditioning='adaln'.*"
      r"expand the preset first",
    ),
    (
      dict(diffusion__endpoint_terms="none"),
      r"diffusion.endpoint_terms='none' is unknown; valid: sampled, md4",
    ),
    (
      dict(training__loss_units="bytes"),
      r"training.loss_units='bytes' is unknown; valid: nats, bits",
    ),
    (
      dict(optimizer__grad_clip_norm=-1.0),
      r"optimizer.grad_clip_norm must be >= 0 \(0: no clipping\)",
    ),
  ],
)
def test_md4_option_values_raise_clear_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    _bad(**overrides)()


def test_md4_preset_resolves_to_md4s_text_network():
  """On text8's shape the preset sets MD4's text8 network; the config passed in is not changed,
  and the expanded one validates and expands to itself."""
  config = load("text8")
  config.model.preset = "md4"
  resolved = config_lib.expand_preset(config)
  model = resolved.model
  assert config.model.norm == "rms" and model.norm == "layer"  # A copy.
  assert (
    model.time_conditioning,
    model.time_input,
    model.time_features,
    model.adaln_activation,
    model.weight_init,
    model.norm_eps,
    model.biases,
    model.mlp,
    model.output_init,
  ) == ("adaln", "t", "ddpm", "sigmoid", "fan_in_mlp_depth", 1e-5, True, "sigmoid_glu", "zeros")
  # MD4's feature_dim 64 is its head dim, token-embedding and time-embedding width; MLP 2048.
  assert (model.embed_dim, model.time_dim, model.time_hidden_dim, model.mlp_dim) == (
    64,
    64,
    256,
    2048,
  )
  config_lib.validate_config(resolved, num_devices=1)
  assert config_lib.expand_preset(resolved).to_dict() == resolved.to_dict()
  plain = load("text8")
  assert config_lib.expand_preset(plain) is plain  # "none": nothing to set.
  assert [config_lib.md4_mlp_dim(d) for d in (64, 192, 256, 768)] == [192, 512, 704, 2048]


def test_md4_preset_owns_its_keys():
  """A key nothing set takes the preset's value; one the config or the command line set to
  anything else, its base value included, is an error naming both values."""
  config = load("tiny")  # mlp_dim 64: neither the base 256 nor MD4's 96 for width 32.
  config.model.preset = "md4"
  with pytest.raises(
    ValueError,
    match=r"model.preset='md4' sets model.mlp_dim=96, but the config sets model.mlp_dim=64: a "
    r"preset owns its keys \(drop model.mlp_dim, or set it to 96\)",
  ):
    config_lib.expand_preset(config)
  config.model.mlp_dim = 96
  assert config_lib.expand_preset(config).model.norm == "layer"
  config.model.norm = "rms"  # The base value, set: no longer taken for "left alone".
  with pytest.raises(ValueError, match=r"sets model.norm='layer', but the config sets model.norm"):
    config_lib.expand_preset(config)
  with pytest.raises(
    ValueError, match=r"sets model.norm='layer', but the command line sets --config.model.norm="
  ):
    config_lib.expand_preset(config, explicit=["model.norm", "num_train_steps"])
  config.model.norm = "layer"
  config_lib.expand_preset(config, explicit=["model.norm"])  # Already MD4's value.
  config.model.type = "ar"
  with pytest.raises(ValueError, match=r"model.preset='md4' is a diffusion denoiser"):
    config_lib.expand_preset(config)


def test_a_config_path_that_names_no_file_is_an_error_not_a_shipped_config():
  assert config_lib.config_path("configs/default.py:bd3").endswith("md4jax/configs/default.py:bd3")
  assert config_lib.config_path("default") == str(config_lib.CONFIG_DIR / "default.py")
  with pytest.raises(ValueError, match=r"no file '/elsewhere/experiments/default.py' \(md4jax"):
    config_lib.config_path("/elsewhere/experiments/default.py:bd3")


def test_a_preset_expands_again_after_a_width_changes():
  """The preset's own values were set by no one: a wider model takes the preset's new widths."""
  config = load("text8")
  config.model.preset = "md4"
  expanded = config_lib.expand_preset(config)
  expanded.model.num_heads = 16
  again = config_lib.expand_preset(expanded)
  assert (again.model.time_dim, again.model.embed_dim) == (48, 48)
