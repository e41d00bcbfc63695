r"""Runs a sweep config: every unfinished run, then the results and figures.

  python -m experiments.sweep --config=configs/sweeps/kimi_synthetic.py \
      --workdir=workdirs/kimi_synthetic [--only=mqar_T512/] [--aggregate_only]

Resumable: finished runs (those with a summary.json) are skipped and a run
killed half way resumes from its last checkpoint. Several processes may work
on one workdir (each claims a run through a lock file); every process writes
results.md, results.json and the figures when it has nothing left to train.
`--only` keeps the runs whose name contains the string (a cell
`mqar_T512/`, a mixer `/gdn_`, one run `mqar_T512/kda_seed1_lr0.003`).
`--extend_to=N` raises the step cap of the selected runs to N: every one
that did not reach its stop_at_accuracy continues from its checkpoint (a
"constant" or "wsd" schedule only; the steps it trained are the longer
run's). With `--extend_step=S` too, only the runs still learning at their
cap (`metrics.run_status`: rising at cap, or under the loss rule falling at
cap) continue, S steps at a time, each until it is solved, plateaued (or
converged) or at N: the compute goes where runs still learn. With
`--depth_first` too, each run goes to its end (first pass and every
extension) before the next starts, so a sweep stopped part way (a session
on a shared machine) leaves whole runs, and at most one unfinished run per
process.
`--list` prints the runs, whether each is done, and where each started one
stands (step, held-out accuracy, status: `sweep_lib.progress`).
`--recall` trains nothing: it bins the held-out accuracy of every finished
Palindrome, MQAR and Stack run by lag (how far back the answer was written)
and writes recall_vs_lag.json and recall_vs_lag_<task>.png
(experiments/sweeps/recall.py); a run already profiled there at its final step
keeps its profile, so only new runs need their checkpoints.
Flags are read here and nowhere else; see experiments/sweeps/sweep_lib.py for
the layout. A mistake (not a sweep config, a selection that matches no run,
flags that do not go together, a step count < 1) is one line on stderr and
exit status 2 (experiments/tools/cli.py; `--verbose` adds the traceback).
"""

import os
import subprocess

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments.sweeps import recall
from experiments.sweeps import sweep_lib
from experiments.sweeps import sweep_markdown
from experiments.sweeps import sweep_report
from experiments.training import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Sweep config, e.g. configs/sweeps/kimi_synthetic.py.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_ONLY = flags.DEFINE_string(
    "only", None, "Train only the runs whose name contains this string.")
_AGGREGATE_ONLY = flags.DEFINE_bool(
    "aggregate_only", False, "Train nothing; write the results of the"
    " finished runs.")
_EXTEND_TO = flags.DEFINE_integer(
    "extend_to", None, "Raise the step cap of the selected runs to this;"
    " unsolved finished runs continue (constant or wsd schedules).",
    lower_bound=1)
_EXTEND_STEP = flags.DEFINE_integer(
    "extend_step", None, "With --extend_to: only the runs still rising at"
    " their cap continue, this many steps at a time, until each is solved,"
    " plateaued or at --extend_to.", lower_bound=1)
_DEPTH_FIRST = flags.DEFINE_bool(
    "depth_first", False, "With --extend_step: take each run to its end"
    " before the next starts (the default: every first pass, then rounds of"
    " extensions).")
_LIST = flags.DEFINE_bool("list", False, "Print the runs and exit.")
_RECALL = flags.DEFINE_bool(
    "recall", False, "Train nothing; write the finished runs' accuracy"
    " against lag (recall_vs_lag.json, recall_vs_lag_<task>.png).")
_RECALL_BATCHES = flags.DEFINE_integer(
    "recall_batches", None, "Held-out batches per run for --recall (default:"
    " the run's train.eval_batches, the set behind its reported accuracy).",
    lower_bound=1)


def _code_version() -> str:
  """The git commit of this checkout (with '+dirty' for local changes)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                            capture_output=True, text=True,
                            check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "."],
                           cwd=root, capture_output=True,
                           text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return commit + ("+dirty" if dirty else "")


def _check_flags() -> None:
  """app.UsageError for flags that do not go together."""
  modes = [f"--{f.name}" for f in (_LIST, _RECALL, _AGGREGATE_ONLY)
           if f.value]
  if len(modes) > 1:
    raise app.UsageError(f"{' and '.join(modes)} do not go together: give"
                         " one.")
  if modes:  # nothing trains: the training flags would be ignored
    unused = {"--list": (_EXTEND_STEP, _DEPTH_FIRST),
              "--recall": (_EXTEND_TO, _EXTEND_STEP, _DEPTH_FIRST),
              "--aggregate_only": (_EXTEND_TO, _EXTEND_STEP, _DEPTH_FIRST,
                                   _ONLY)}[modes[0]]
    given = [f"--{f.name}" for f in unused if f.value not in (None, False)]
    if given:
      raise app.UsageError(f"{', '.join(given)} would be ignored with"
                           f" {modes[0]}: leave it out.")
  if _RECALL_BATCHES.value is not None and not _RECALL.value:
    raise app.UsageError("--recall_batches goes with --recall.")
  if _ONLY.value == "":
    raise app.UsageError("--only is empty: give part of a run name (a cell"
                         " mqar_T512/, a mixer /gdn_), or leave it out for"
                         " every run.")


def main(argv):
  del argv  # no positional arguments (cli.run)
  sweep, workdir = _CONFIG.value, _WORKDIR.value
  if sweep is None or not workdir:
    raise app.UsageError("--config and --workdir are required.")
  _check_flags()
  train.check_folder(workdir, "--workdir")
  if _LIST.value:
    runs = sweep_lib.select(sweep_lib.expand(sweep), _ONLY.value)
    if _EXTEND_TO.value is not None:
      runs = sweep_lib.extend(runs, _EXTEND_TO.value)
    for run in runs:
      run_dir = os.path.join(workdir, run.name)
      done = sweep_lib.is_done(run_dir, run.config)
      where = sweep_lib.progress(run_dir)
      print(f"{'done' if done else 'todo'}  {run.name}"
            + (f"  {where}" if where else ""))
    return
  train.quiet_orbax_logs()
  if _RECALL.value:
    runs = sweep_lib.select(sweep_lib.expand(sweep), _ONLY.value)
    sweep_lib.check_workdir(runs, workdir)
    out = recall.sweep_recall_profiles(
        sweep, workdir, runs, eval_batches=_RECALL_BATCHES.value,
        metadata=dict(profiled_at=_code_version()))
    missing = ("; not profiled (no checkpoint): "
               + ", ".join(out["unprofiled"]) if out["unprofiled"] else "")
    print(f"Recall profiles of {len(out['runs'])} runs in {workdir}{missing}.")
    return
  if not _AGGREGATE_ONLY.value:
    sweep_lib.run_sweep(sweep, workdir, only=_ONLY.value,
                        code_version=_code_version(),
                        extend_to=_EXTEND_TO.value,
                        extend_step=_EXTEND_STEP.value,
                        depth_first=_DEPTH_FIRST.value)
  results = sweep_report.aggregate(
      sweep, workdir, metadata=dict(aggregated_at=_code_version()))
  print(sweep_markdown.results_markdown(results))  # the CLI's one output

