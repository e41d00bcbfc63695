"""`python -m experiments.sweep`: the command line of a sweep.

The command (its flags, `main` and the description --help prints) lives in
experiments/sweeps/sweep.py; this module keeps its name.
"""

from absl import flags

from experiments.sweeps import sweep
from experiments.tools import cli

if __name__ == "__main__":
  __doc__ = sweep.__doc__  # what --help prints
  flags.adopt_module_key_flags(sweep)
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(sweep.main)
