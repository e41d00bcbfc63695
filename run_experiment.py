r"""Trains one experiment config: the absl entry point.

  python run_experiment.py --config=configs/mqar.py --workdir=workdirs/mqar_kda
  python run_experiment.py --config=configs/mqar.py:smoke --workdir=/tmp/smoke \
      --config.model.mixer=kda_zeroed --config.model.kda.backend=tokamax \
      --config.seed=3

Several processes (hosts of a TPU pod slice, or processes on one machine),
each running the same command:

  # a TPU pod slice (JAX finds the coordinator and the process ids itself):
  python run_experiment.py --config=configs/mqar.py:tpu --workdir=<shared> \
      --multiprocess
  # or explicitly, e.g. two processes on one machine (process 0 and 1):
  python run_experiment.py --config=... --workdir=<shared> \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0

The mesh (config.mesh) must then span every device of every process.

The config is locked: a misspelt override fails before anything runs.
Rerunning with the same workdir resumes from the latest checkpoint. With
a KDA backend that needs a TPU (`model.kda.backend=tokamax`, alias
`mosaic`, or `pallas`) on a machine whose default device is not a TPU, the
run goes inside `experiments.training.interpret.interpret_mode()`.
Flags are read here, in `main`, and nowhere else. A mistake in the command
(a missing config file, an unknown or ill-typed field, a value out of range,
a workdir that is a file) is one line on stderr and exit status 2, before
anything runs; `--verbose` adds the traceback (experiments/tools/cli.py).
"""

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from experiments.tools import cli
from experiments.training import compilation_cache
from experiments.training import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/mqar.py[:smoke].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (resumed when it has checkpoints).")
_STOP_AT_STEP = flags.DEFINE_integer(
    "stop_at_step", None,
    "Stop after this step without the final checkpoint or summary, as if "
    "killed (for resume tests); rerun without it to finish.", lower_bound=1)
_MULTIPROCESS = flags.DEFINE_bool(
    "multiprocess", False,
    "Call jax.distributed.initialize() with no arguments: JAX detects the "
    "cluster (Cloud TPU pod slices, Slurm, Open MPI).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "jax.distributed.initialize's coordinator_address (host:port of process "
    "0), with --num_processes and --process_id.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "jax.distributed.initialize's num_processes.",
    lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "jax.distributed.initialize's process_id.",
    lower_bound=0)
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", compilation_cache.DEFAULT_DIR,
    compilation_cache.FLAG_HELP)


def _initialize_distributed() -> None:
  """jax.distributed.initialize from the flags; nothing without them."""
  explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise app.UsageError(
          "--coordinator_address, --num_processes and --process_id go"
          " together.")
    if _PROCESS_ID.value >= _NUM_PROCESSES.value:
      raise app.UsageError(
          f"--process_id ({_PROCESS_ID.value}) must be below --num_processes"
          f" ({_NUM_PROCESSES.value}).")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _MULTIPROCESS.value:
    jax.distributed.initialize()
  else:
    return
  logging.info("Process %d of %d; %d local of %d devices.",
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())


def main(argv):
  del argv  # no positional arguments (cli.run)
  config = _CONFIG.value
  workdir = _WORKDIR.value
  if config is None or not workdir:
    raise app.UsageError("--config and --workdir are required.")
  train.check_run(config, workdir)  # before anything is logged or run
  _initialize_distributed()  # before any other JAX call
  compilation_cache.enable(_COMPILATION_CACHE_DIR.value)
  train.quiet_orbax_logs()
  logging.info("Config:\n%s", config)
  summary = train.train_and_evaluate(config, workdir,
                                     stop_at_step=_STOP_AT_STEP.value)
  logging.info("Summary: %s", summary)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  cli.run(main)
