"""JAX's persistent compilation cache, for the command-line entry points.

A run's first step waits for XLA to compile the model, the loss and the
optimizer (tens of seconds on a TPU, as long on a small CPU); JAX can keep
compiled programs on disk and load them in the next process that compiles
the same program on the same machine and JAX version. The entry points
(`run_experiment.py`, `experiments.ablate`, `experiments.sweep`,
`experiments.generate`) turn it on with `enable(--compilation_cache_dir)`
before anything compiles; the library itself never sets it.
"""

import os

from absl import logging
import jax

DEFAULT_DIR = "~/.cache/linear_attention/jax_compilation_cache"
FLAG_HELP = ("Directory of JAX's persistent compilation cache (a later run"
             " of the same programs on this machine loads them instead of"
             " compiling); '' leaves JAX's own setting (off unless the"
             " environment's JAX_COMPILATION_CACHE_DIR names one).")


def enable(directory: str) -> None:
  """Caches every compiled program under `directory` ('' or None: JAX's
  own setting stays, off unless JAX_COMPILATION_CACHE_DIR names a folder)."""
  if not directory:
    return
  path = os.path.expanduser(directory)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a run compiles dozens of small
  # ones (data placement, evaluation, logging) besides the training step.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  logging.info("JAX compilation cache: %s", path)
