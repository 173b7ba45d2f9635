"""md4jax: masked (absorbing-state) discrete diffusion language models in JAX."""

import setuptools

setuptools.setup(
  name="md4jax",
  version="0.2.0",
  description="Masked discrete diffusion language models (MD4 / MDLM) in JAX and Flax.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  author="The md4jax authors",
  license="Apache-2.0",
  license_files=["LICENSE"],
  packages=setuptools.find_packages(include=["md4jax", "md4jax.*"]),
  # jax 0.10 needs Python >= 3.11; CI (.ci/run) tests on Python 3.11.
  python_requires=">=3.11",
  install_requires=[
    "jax>=0.10,<0.12",
    "flax>=0.12,<0.14",
    "optax>=0.2.5,<0.4",
    "orbax-checkpoint>=0.12,<0.14",
    "ml-collections>=1.0,<2",
    "chex>=0.1.90,<0.3",
    "grain>=0.2.18,<0.4",
    "tensorflow-datasets>=4.9.8,<5",
    "importlib_resources>=6",  # tensorflow-datasets on Python 3.11 imports it.
    "tokenizers>=0.21,<1",
    "jinja2>=3.1,<4",  # Released models' chat templates (sample.chat), rendered as transformers does.
    "safetensors>=0.4.2,<1",  # Hugging Face weights in and out (md4jax.convert); bfloat16 from 0.4.2.
    "numpy>=1.26,<3",
    "scipy>=1.12",  # jax's own dependency; the duality's quadrature (md4jax.diffusion.duality).
    "tensorboardX>=2.6,<3",  # TensorBoard event files without TensorFlow.
    "pillow>=10",  # Animated GIFs of sampling trajectories.
    "matplotlib>=3.8",  # PNG plots of training curves, bounds and sampling frontiers.
  ],
  extras_require={
    # The test suite: python -m pytest -q tests (README, Development).
    "test": ["pytest>=8", "scipy>=1.11", "ruff>=0.17,<0.18", "lm-eval>=0.4.13,<0.5"],
    # EleutherAI's lm-evaluation-harness: lm_eval --model md4jax (no torch needed).
    "lmeval": ["lm-eval>=0.4.13,<0.5"],
    # Hugging Face transformers with torch: only to write the conversion's golden files.
    "hf": ["transformers>=4.45", "torch>=2.4"],
    # libtpu: TPU VMs, and the TPU compiler that md4jax.aot (and its tests) use on any machine.
    "tpu": ["jax[tpu]>=0.10,<0.12"],
    # TensorFlow: LM1B and OpenWebText read through tensorflow-datasets when no local copy is given.
    "tf": ["tensorflow-cpu>=2.18"],
  },
  classifiers=[
    "Development Status :: 3 - Alpha",
    "Intended Audience :: Science/Research",
    "License :: OSI Approved :: Apache Software License",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3",
    "Programming Language :: Python :: 3 :: Only",
    "Programming Language :: Python :: 3.11",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
  ],
)
