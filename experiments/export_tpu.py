"""`python -m experiments.export_tpu`: a config's train step, lowered for TPU.

The command (its flags, `main` and the description --help prints) lives in
experiments/tools/export_tpu.py; this module keeps its name.
"""

from experiments.tools import cli
from experiments.tools import export_tpu

if __name__ == "__main__":
  cli.run(export_tpu.main, flags_parser=export_tpu.absl_flags_only)
