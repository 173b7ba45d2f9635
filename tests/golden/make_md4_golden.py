r"""Writes MD4's golden files for tests/test_md4_parity.py, running MD4's own code.

  JAX_PLATFORMS=cpu python tests/golden/make_md4_golden.py --md4_src=PATH \
      [--text=../shared/data/wiki_text8_dev.txt]

PATH is a checkout of google-deepmind/md4 (the files here were written from commit
b9fbf29216f818cccff46cb5727199f86f35593e). Its modules are imported from there unchanged;
the packages they import at module level but never call on this path (clu, distrax,
seaborn, tensorflow, tensorflow_probability, transformers, datasets) are replaced by
stubs when they are not installed (`install_stubs`). --text is text8-format text (a-z and
spaces) the training batches are cut from.

The model is MD4's text8 network (md4/configs/md4/text8.py) at md4_golden's small shape.
Files (md4_golden names them):
  md4_init.npz    MD4's initial params (md4/train.py create_train_state, PRNGKey(SEED)).
  md4_logits.npz  tokens z [B, L] (some masked), times t [B], and MD4's logits of the
                  perturbed initial params (md4_golden.perturb) and of its trained params.
  md4_train.npz   NUM_STEPS steps of md4/train.py's train_step (under pmap, one device): the
                  batches, MD4's own draws of t [S, B] and of the masked positions [S, B, L]
                  (bits, packed), its loss [S] (bits per token) and the final raw and EMA values
                  of md4_golden.FINAL_LEAVES.

The draws are read by running MD4's loss with the key its train step derives, with
MD4Model.forward_sample intercepted; the loss of that run must equal the train step's
(checked), so the draws are the train step's own.
"""

import argparse
import functools
import importlib.util
import os
import pathlib
import sys
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import md4_golden  # noqa: E402  pylint: disable=wrong-import-position


def _stub_module(name: str, **attrs) -> types.ModuleType:
  """A module whose unknown public attributes are placeholder classes that fail when used."""
  module = types.ModuleType(name)
  module.__dict__.update(attrs)

  class Placeholder:
    def __init__(self, *args, **kwargs):
      raise NotImplementedError(f"{name} is a stub here: MD4's text training path never uses it.")

  def __getattr__(attr):
    if attr.startswith("__"):
      raise AttributeError(attr)
    return type(attr, (Placeholder,), {})

  module.__getattr__ = __getattr__
  return module


def _clu_stubs() -> dict:
  """clu as md4/train.py uses it on this path: metric classes that hand the step's values
  through as a dict, and a parameter overview that logs nothing."""

  class _Collection:
    names: tuple = ()

    @classmethod
    def gather_from_model_output(cls, **outputs):
      return {name: outputs[name] for name in cls.names}

  class Collection:
    @staticmethod
    def create(**metrics):
      return type("Metrics", (_Collection,), {"names": tuple(metrics)})

  class _FromOutput:
    @staticmethod
    def from_output(name):
      return name

  metrics = _stub_module(
    "clu.metrics", Collection=Collection, Average=_FromOutput, LastValue=_FromOutput
  )
  overview = _stub_module("clu.parameter_overview", log_parameter_overview=lambda *a, **k: None)
  modules = {"clu.metrics": metrics, "clu.parameter_overview": overview}
  for name in ("platform", "metric_writers", "periodic_actions"):
    modules[f"clu.{name}"] = _stub_module(f"clu.{name}")
  modules["clu"] = _stub_module("clu", **{k.split(".")[1]: v for k, v in modules.items()})
  return modules


def _package_stubs(*names: str) -> dict:
  """Stub modules for dotted names, each a child attribute of its parent."""
  modules = {name: _stub_module(name) for name in names}
  for name in names:
    if "." in name:
      parent, child = name.rsplit(".", 1)
      setattr(modules[parent], child, modules[name])
  return modules


def install_stubs() -> list:
  """Stubs for the packages MD4's model and train step import but do not use here, each only
  when it is not installed; returns their names."""
  if importlib.util.find_spec("tensorflow") is None and importlib.util.find_spec(
    "tensorflow_datasets"
  ):
    # tensorflow_datasets imports without TensorFlow, but not once a module of that name exists.
    import tensorflow_datasets  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  if importlib.util.find_spec("tensorflow") is None and importlib.util.find_spec("datasets"):
    # datasets (lm-eval's) probes for TensorFlow when imported, and a stub has no import spec.
    import datasets  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  factories = {
    "clu": _clu_stubs,
    "distrax": lambda: {"distrax": _stub_module("distrax")},
    "seaborn": lambda: {"seaborn": _stub_module("seaborn")},
    "tensorflow": lambda: {"tensorflow": _stub_module("tensorflow")},
    "transformers": lambda: {"transformers": _stub_module("transformers")},
    "datasets": lambda: _package_stubs("datasets", "datasets.distributed"),
    "tensorflow_probability": lambda: _package_stubs(
      "tensorflow_probability",
      "tensorflow_probability.substrates",
      "tensorflow_probability.substrates.jax",
    ),
  }
  installed = []
  for name, factory in factories.items():
    if name not in sys.modules and importlib.util.find_spec(name) is None:
      sys.modules.update(factory())
      installed.append(name)
  return installed


def pmapped_train_step(md4_train, model, optimizer, metrics_class, lr_fn, ema_rate: float):
  """md4/train.py's train_step under pmap (axis "batch"), as MD4's training loop runs it."""
  import jax  # pylint: disable=import-outside-toplevel

  return jax.pmap(
    functools.partial(
      md4_train.train_step,
      model=model,
      optimizer=optimizer,
      train_metrics_class=metrics_class,
      learning_rate_fn=lr_fn,
      ema_rate=ema_rate,
    ),
    axis_name="batch",
  )


def md4_draws_fn(model, mask_id: int):
  """Jitted fn(params, step_rng, x) -> (loss, t [B], masked [B, L]): MD4's loss with the key
  md4/train.py's train_step derives from its state's rng (one device), and the t and masks it
  drew (MD4Model.forward_sample intercepted)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  @jax.jit
  def draws(params, step_rng, x):
    rng, _ = jax.random.split(step_rng)
    rng = jax.random.fold_in(rng, 0)  # jax.lax.axis_index("batch") of the one device.
    rng, sample_rng = jax.random.split(rng)
    _, dropout_rng = jax.random.split(rng)
    seen = {}

    def intercept(call, args, kwargs, context):
      out = call(*args, **kwargs)
      if context.method_name == "forward_sample":
        seen["t"], seen["zt"] = args[1], out
      return out

    with nn.intercept_methods(intercept):
      stats = model.apply(
        {"params": params},
        x,
        cond=None,
        train=True,
        rngs={"sample": sample_rng, "dropout": dropout_rng},
      )
    return stats["loss"], jnp.reshape(seen["t"], (-1,)), seen["zt"] == mask_id

  return draws


def text_batches(path: str, num_steps: int, batch_size: int, seq_len: int, seed: int):
  """[S, B, L] uint8 windows of text8-format text at random offsets: a-z -> 0-25, else 26
  (md4/input_pipeline.py's text8 ids)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  text = np.frombuffer(pathlib.Path(path).read_bytes(), np.uint8)
  ids = np.where((text >= ord("a")) & (text <= ord("z")), text - ord("a"), 26).astype(np.uint8)
  starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len, (num_steps, batch_size))
  return ids[starts[..., None] + np.arange(seq_len)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--md4_src", required=True, help="a checkout of google-deepmind/md4")
  parser.add_argument(
    "--text", default=str(md4_golden.DIR.parents[2] / "shared" / "data" / "wiki_text8_dev.txt")
  )
  args = parser.parse_args()
  print("stubbed (not installed):", ", ".join(install_stubs()) or "nothing")
  sys.path.insert(0, str(pathlib.Path(args.md4_src).resolve()))

  import flax.jax_utils  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from md4 import train as md4_train  # pylint: disable=import-outside-toplevel
  from md4.configs.md4 import text8  # pylint: disable=import-outside-toplevel

  g = md4_golden
  config = text8.get_config()
  config.n_layers, config.feature_dim, config.num_heads = g.NUM_LAYERS, g.FEATURE_DIM, g.NUM_HEADS
  config.vocab_size, config.data_shape, config.batch_size = g.VOCAB_SIZE, (g.SEQ_LEN,), g.BATCH_SIZE
  config.learning_rate, config.warmup_steps = g.LEARNING_RATE, g.WARMUP_STEPS
  config.num_train_steps, config.ema_rate = g.NUM_STEPS, g.EMA_DECAY
  assert (config.b2, config.weight_decay, config.clip, config.dropout_rate) == (
    0.999,
    0.0,
    0.0,
    0.0,
  )
  lr_fn = functools.partial(
    md4_train.get_learning_rate,
    base_learning_rate=config.learning_rate,
    num_steps=config.num_train_steps,
    warmup_steps=config.warmup_steps,
    schedule_type=config.learning_rate_schedule,
  )
  shape = (g.BATCH_SIZE, g.SEQ_LEN)
  model, optimizer, state, metrics_class = md4_train.create_train_state(
    config, jax.random.PRNGKey(g.SEED), input_shape=shape, schedule_fn=lr_fn
  )
  init_flat = g.flatten({"classifier": state.params["classifier"]})
  assert set(state.params) == {"classifier"}, set(state.params)

  # Fixed inputs of the logit comparison: times across [0, 1], about half the tokens masked.
  rng = np.random.default_rng(1)
  t_fixed = np.asarray([0.0, 1e-3, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0], np.float32)
  z_fixed = rng.integers(0, g.VOCAB_SIZE, shape).astype(np.int32)
  z_fixed[rng.random(shape) < 0.5] = g.VOCAB_SIZE

  @jax.jit
  def md4_logits(params, z, t):
    return model.apply({"params": params}, z, t, method=model.predict_x)[0]

  perturbed = g.unflatten(g.perturb(init_flat))
  logits_perturbed = np.asarray(md4_logits(perturbed, z_fixed, t_fixed))
  assert np.abs(logits_perturbed).max() > 0.1

  draws = md4_draws_fn(model, g.VOCAB_SIZE)

  step_fn = pmapped_train_step(md4_train, model, optimizer, metrics_class, lr_fn, config.ema_rate)
  batches = text_batches(args.text, g.NUM_STEPS, g.BATCH_SIZE, g.SEQ_LEN, seed=2)
  replicated = flax.jax_utils.replicate(state)
  losses, times, masks = [], [], []
  for step in range(g.NUM_STEPS):
    x = jnp.asarray(batches[step], jnp.int32)
    current = flax.jax_utils.unreplicate(replicated)
    loss, t, masked = draws(current.params, current.rng, x)
    replicated, metrics = step_fn(train_state=replicated, batch={"text": x[None]})
    step_loss = float(flax.jax_utils.unreplicate(metrics)["loss"])
    assert abs(step_loss - float(loss)) <= 1e-5 * abs(step_loss), (step, step_loss, float(loss))
    losses.append(step_loss)
    times.append(np.asarray(t))
    masks.append(np.asarray(masked))
    if step % 50 == 0 or step == g.NUM_STEPS - 1:
      print(f"step {step + 1}: loss {step_loss:.4f} bits/token")
  final = flax.jax_utils.unreplicate(replicated)
  final_flat = g.flatten({"classifier": final.params["classifier"]})
  ema_flat = g.flatten({"classifier": final.ema_params["classifier"]})
  logits_trained = np.asarray(md4_logits(final.params, z_fixed, t_fixed))

  np.savez_compressed(g.INIT, **init_flat)
  np.savez_compressed(
    g.LOGITS, z=z_fixed, t=t_fixed, perturbed=logits_perturbed, trained=logits_trained
  )
  np.savez_compressed(
    g.TRAIN,
    tokens=batches,
    t=np.stack(times).astype(np.float32),
    masked=np.packbits(np.stack(masks), axis=-1),
    loss=np.asarray(losses, np.float32),
    **{f"final/{k}": final_flat[k] for k in g.FINAL_LEAVES},
    **{f"final_ema/{k}": ema_flat[k] for k in g.FINAL_LEAVES},
  )
  for path in (g.INIT, g.LOGITS, g.TRAIN):
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
  main()
