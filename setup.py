"""Install: `pip install -e '.[test]'` (the Makefile does this into .venv)."""

import setuptools

setuptools.setup(
    name="linear_attention",
    version="0.1.0",
    description=(
        "Haiku reference implementation of Kimi Delta Attention and the"
        " DeepSeek-V4 CSA indexer score, with memory-probing experiments."
    ),
    packages=setuptools.find_packages(
        include=["linear_attention*", "experiments*", "configs*"]
    ),
    python_requires=">=3.12",
    install_requires=[
        # Tested with jax/jaxlib 0.12.0.1; tokamax 0.0.17 needs >= 0.11.1.
        "jax>=0.12.0,<0.13",
        "jaxlib>=0.12.0,<0.13",
        # The first public release whose kimi_delta_attention has the
        # mosaic, xla and xla_chunked implementations.
        "tokamax==0.0.17",
        "dm-haiku>=0.0.16",
        "optax>=0.2.5",
        "absl-py>=2.1",
        "ml-collections>=1.0",
        "chex>=0.1.90",
        "numpy>=2.0",
        "orbax-checkpoint>=0.11",
        "tensorboardX>=2.6",
        "matplotlib>=3.9",
    ],
    extras_require={
        "test": ["pytest>=8.0", "pytest-xdist>=3.6", "hypothesis>=6.100"],
        # On a TPU VM: pip install -e '.[tpu]'. jax[tpu] pins the libtpu its
        # Pallas lowering needs (JAX 0.12: libtpu==0.0.50.*; with an older
        # libtpu, Pallas TPU kernels fail to load). Tested on TPU v5e with
        # libtpu 0.0.50.1 (docs/tpu.md).
        "tpu": ["jax[tpu]>=0.12.0,<0.13"],
    },
)
