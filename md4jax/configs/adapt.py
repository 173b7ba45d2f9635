r"""A causal (ar) model fine-tuned into a masked diffusion model (mdm): DiffuLLaMA's and Dream's
adaptation of an autoregressive LM (docs/adapt.md).

  python -m md4jax.main --config=configs/adapt.py:/tmp/ar --workdir=/tmp/adapted \
      --config.num_train_steps=1000

The argument is an ar workdir, md4jax-trained or converted from Hugging Face (python -m
md4jax.convert). The run takes that workdir's config (model, data, optimizer, evaluation and
sampling settings) with these changes: model.type 'mdm' (bidirectional attention, the MDM
objective), training.init_from = the workdir (its EMA params start the run; the mask token's
embedding row, the ar model's BOS row, is already there), model.shifted_prediction on (the
next-token head predicts each masked token from the positions before it) and the attention
annealed from causal to bidirectional over the first ANNEAL_STEPS steps. Override any of them
on the command line, e.g. --config.training.attention_anneal_steps=0.
"""

import pathlib

from md4jax import config as config_lib

# DiffuLLaMA anneals over a small share of the run; 200 steps is the CPU presets' warmup.
ANNEAL_STEPS = 200


def get_config(workdir: str):
  config = config_lib.workdir_config(workdir, "configs/adapt.py:PATH")
  if config.model.type != "ar":
    raise ValueError(
      f"{workdir} holds a model.type={config.model.type!r} model; configs/adapt.py adapts an "
      "'ar' one (continue an mdm with configs/workdir.py)."
    )
  config.model.type = "mdm"
  config.model.shifted_prediction = True
  config.training.init_from = str(pathlib.Path(workdir).absolute())
  config.training.attention_anneal_steps = ANNEAL_STEPS
  return config
