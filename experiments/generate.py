"""`python -m experiments.generate`: continues a prompt with a text model.

The command (its flags, `main` and the description --help prints) lives in
experiments/tools/generate.py; this module keeps its name.
"""

from absl import flags

from experiments.tools import cli
from experiments.tools import generate

if __name__ == "__main__":
  __doc__ = generate.__doc__  # what --help prints
  flags.adopt_module_key_flags(generate)
  cli.run(generate.main)
