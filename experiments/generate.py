r"""Continues a prompt with a trained text model: the absl entry point.

  python -m experiments.generate --workdir=workdirs/text \
      --prompt="def main(" --max_new_tokens=200 --temperature=0.8 --top_k=40

Reads the run's `config.json` and latest checkpoint, encodes the prompt as
UTF-8 bytes (the text task's tokens), prefills the model's cache with it and
decodes token by token (`experiments.generation.generate`); prints the
continuation. Greedy at `--temperature=0`.
"""

import json
import os
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import checkpoints
from experiments import generation
from experiments import model as model_lib
from experiments import program as program_lib
from experiments import tasks as tasks_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "A text run's directory.")
_PROMPT = flags.DEFINE_string("prompt", "", "The text to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 200,
                                       "Bytes to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0,
                                  "0: greedy; else sample at this temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely"
                              " bytes (0: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def load_run(workdir: str):
  """(config, model, params, step) of a run's latest checkpoint."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"--workdir {workdir!r} holds no config.json (not a"
                     " run directory).")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  task = tasks_lib.make_task(**config.task.to_dict())
  model = model_lib.make_model(config.model, task.vocab_size)
  params = model.init(jax.random.key(config.seed),
                      jnp.zeros((1, 8), jnp.int32))
  optimizer, _ = program_lib.make_optimizer(config.train)
  params, step = checkpoints.latest_params(workdir, params,
                                           optimizer.init(params))
  return config, model, params, step


def continue_text(workdir: str, prompt: str, *, max_new_tokens: int,
                  temperature: float, top_k: int, seed: int) -> str:
  """The run's continuation of `prompt` (bytes decoded as UTF-8)."""
  generation.check_sampling(temperature, top_k)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
  config, model, params, _ = load_run(workdir)
  if config.task.name != "text":
    raise ValueError(f"the run in {workdir!r} trained on task"
                     f" {config.task.name!r}; generation takes a 'text' run.")
  tokens = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)
  if not len(tokens):
    raise ValueError("--prompt must hold at least one byte.")
  cache = model_lib.init_cache(config.model, 1,
                               max_len=len(tokens) + max_new_tokens)
  with model_lib.host_context(config.model):
    out = generation.generate(
        model.apply, params, cache, jnp.asarray(tokens[None]),
        jax.random.key(seed), max_new_tokens=max_new_tokens,
        temperature=float(temperature), top_k=top_k)
  return bytes(np.asarray(out[0], np.uint8)).decode("utf-8",
                                                    errors="replace")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  try:
    text = continue_text(
        _WORKDIR.value, _PROMPT.value, max_new_tokens=_MAX_NEW_TOKENS.value,
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, seed=_SEED.value)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(_PROMPT.value + text)
  return 0


if __name__ == "__main__":
  app.run(main)
