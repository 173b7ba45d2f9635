"""md4jax: masked (absorbing-state) discrete diffusion language models in JAX."""

import setuptools

setuptools.setup(
    name="md4jax",
    version="0.1.0",
    description="Masked discrete diffusion language models (MD4 / MDLM) in JAX and Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["md4jax", "md4jax.*"]),
    python_requires=">=3.10",
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
        "numpy>=1.26,<3",
        "tensorboardX>=2.6,<3",  # TensorBoard event files without TensorFlow.
        "pillow>=10",  # Animated GIFs of sampling trajectories.
        "matplotlib>=3.8",  # PNG plots of training curves, bounds and sampling frontiers.
    ],
    extras_require={
        "test": ["pytest>=8", "scipy>=1.11"],
        # libtpu: TPU VMs, and the TPU compiler that md4jax.aot (and its tests) use on any machine.
        "tpu": ["jax[tpu]>=0.10,<0.12"],
        "tf": ["tensorflow-cpu>=2.18"],
    },
)
