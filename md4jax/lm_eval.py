r"""EleutherAI's lm-evaluation-harness command line with the md4jax model registered
(docs/lm_eval.md). lm-eval's own `lm_eval` command knows only its built-in models:

  python -m md4jax.lm_eval --model md4jax --model_args workdir=DIR,draws=8 \
      --tasks my_task --include_path TASKS_DIR --batch_size 32

Every argument is lm-eval's; an md4jax error (a workdir, a model_arg, a request) is one line.
Needs the lmeval extra: pip install -e '.[lmeval]'.
"""

import sys

from md4jax import user_errors


def main():
  try:
    from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
  except ImportError:
    sys.exit("md4jax: error: lm-eval is not installed; pip install -e '.[lmeval]'.")
  from md4jax.app import harness  # pylint: disable=g-import-not-at-top  (registers md4jax)

  with user_errors.in_one_line("md4jax", (harness.HarnessError,)):
    cli_evaluate()


if __name__ == "__main__":
  main()
