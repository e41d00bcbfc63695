r"""Trains one experiment config: the absl entry point.

  python run_experiment.py --config=configs/mqar.py --workdir=workdirs/mqar_kda
  python run_experiment.py --config=configs/mqar.py:smoke --workdir=/tmp/smoke \
      --config.model.mixer=kda_zeroed --config.model.kda.backend=mosaic \
      --config.seed=3

The config is locked: a misspelt override fails before anything runs.
Rerunning with the same workdir resumes from the latest checkpoint. With
`model.kda.backend=mosaic` on a machine whose default device is not a TPU,
the run goes inside `linear_attention.ops.kda.mosaic.interpret_mode()`.
Flags are read here, in `main`, and nowhere else.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/mqar.py[:smoke].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (resumed when it has checkpoints).")
_STOP_AT_STEP = flags.DEFINE_integer(
    "stop_at_step", None,
    "Stop after this step without the final checkpoint or summary, as if "
    "killed (for resume tests); rerun without it to finish.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  workdir = _WORKDIR.value
  if config is None or not workdir:
    raise app.UsageError("--config and --workdir are required.")
  train.quiet_orbax_logs()
  logging.info("Config:\n%s", config)
  with train.backend_context(config):
    summary = train.train_and_evaluate(config, workdir,
                                       stop_at_step=_STOP_AT_STEP.value)
  logging.info("Summary: %s", summary)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
