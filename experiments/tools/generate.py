r"""Continues a prompt with a trained text model: the absl entry point.

  python -m experiments.generate --workdir=workdirs/text \
      --prompt="def main(" --max_new_tokens=200 --temperature=0.8 --top_k=40

Reads the run's `config.json` and latest checkpoint, encodes the prompt as
UTF-8 bytes (the text task's tokens), prefills the model's cache with it and
decodes token by token (`experiments.tools.generation.continue_text`); prints
the prompt and its continuation. Greedy at `--temperature=0`. A mistake (a
workdir that is not a run, a damaged checkpoint, a bad sampling setting) is
one line on stderr and exit status 2 (experiments/tools/cli.py; `--verbose` adds
the traceback).
"""

from absl import app
from absl import flags

from experiments.tools import generation
from experiments.training import checkpoints
from experiments.training import compilation_cache

_WORKDIR = flags.DEFINE_string("workdir", None, "A text run's directory.")
_PROMPT = flags.DEFINE_string("prompt", "", "The text to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 200,
                                       "Bytes to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0,
                                  "0: greedy; else sample at this temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely"
                              " bytes (0: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", compilation_cache.DEFAULT_DIR,
    compilation_cache.FLAG_HELP)


def main(argv):
  del argv  # no positional arguments (cli.run)
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required.")
  compilation_cache.enable(_COMPILATION_CACHE_DIR.value)
  checkpoints.quiet_orbax_logs()
  text = generation.continue_text(
      _WORKDIR.value, _PROMPT.value, max_new_tokens=_MAX_NEW_TOKENS.value,
      temperature=_TEMPERATURE.value, top_k=_TOP_K.value, seed=_SEED.value)
  print(_PROMPT.value + text)
  return 0

