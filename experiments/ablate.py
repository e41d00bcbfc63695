"""`python -m experiments.ablate`: the command line of an ablation.

The command (its flags, `main` and the description --help prints) lives in
experiments/sweeps/ablate.py; this module keeps its name.
"""

from absl import flags

from experiments.sweeps import ablate
from experiments.tools import cli

if __name__ == "__main__":
  __doc__ = ablate.__doc__  # what --help prints
  flags.adopt_module_key_flags(ablate)
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(ablate.main)
