"""Sweeps: a grid of ordinary runs, resumable, with seeds aggregated.

A sweep config (e.g. configs/sweeps/kimi_synthetic.py) holds

* `base`: an ordinary experiment config (model, train, mesh); its `task`,
  `seed`, `model.mixer`, `train.learning_rate` and `train.num_steps` are
  set per run;
* `cells`: a tuple of dicts `dict(task=<task fields>, num_steps=<cap>,
  batch_size=<B>)`, one per (task, length); `batch_size` (optional) sets
  the training and held-out batch of that cell, `length_curriculum`
  (optional) its `train.length_curriculum`;
* `mixers`, `seeds`, `learning_rates`: the axes crossed with every cell;
  a mixer is a `model.mixer` name or the name of a variant;
  `learning_rates` is a tuple for every mixer or a dict `{mixer: tuple}`
  (rates chosen per mixer); a cell's own `learning_rates` (same forms,
  optional) replaces it for that cell (rates chosen per mixer and task);
* `variants` (optional): `{name: ((dotted field, value), ...)}`, a named
  model variant, e.g. `kda_negeig: (("model.mixer", "kda"),
  ("model.kda.allow_neg_eigval", True))` (configs/sweeps/parity.py);
* `ablation`: `dict(mixer=..., seq_len=..., seeds=...)`, extra runs of one
  mixer (e.g. `kda_zeroed`) on the cells of that length, at the first
  mixer's first learning rate in that cell.

`expand(sweep)` lists the runs; `run_sweep` trains every run that is not
finished (no `summary.json`, or with `extend_to` a raised step cap) into `<workdir>/<task>_T<len>/<mixer>_seed<s>_lr<lr>/`
(each an ordinary, resumable run directory), so a killed sweep continues
where it stopped; a run directory that holds a run of a different config
(the sweep config was edited) stops the sweep and its aggregation with a
ValueError naming the runs and fields. Several processes may work on one
workdir at once, on one host or several sharing it: each run is claimed
through `<run dir>.lock` (experiments/sweeps/run_lock.py: host, pid and a lease
the trainer refreshes; taken over only when its owner is provably gone).

Each run directory also gets `commits.txt`, the commit(s) of the code that
trained it (one line per commit, in order, when a run was resumed at
another), passed in by the CLI; results.md says how many runs each commit
trained.

The tables and figures of a sweep's finished runs:
experiments/sweeps/sweep_report.py.
"""

import copy
import dataclasses
import json
import os
import time
from typing import Sequence

from absl import logging
import jax
import ml_collections

from experiments.sweeps import run_lock
from experiments.training import checkpoints
from experiments.training import metrics as metrics_lib
from experiments.training import resume
from experiments.training import train


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep: where it goes and the config it trains."""

  name: str  # "<task>_T<len>/<mixer>_seed<s>_lr<lr>"
  task: str
  seq_len: int
  mixer: str
  seed: int
  learning_rate: float
  config: ml_collections.ConfigDict


def cell_name(task: str, seq_len: int) -> str:
  return f"{task}_T{seq_len}"


def run_name(task: str, seq_len: int, mixer: str, seed: int,
             lr: float) -> str:
  return f"{cell_name(task, seq_len)}/{mixer}_seed{seed}_lr{lr:g}"


def _run(sweep, cell, mixer: str, seed: int, lr: float) -> Run:
  config = copy.deepcopy(sweep.base)
  config.unlock()
  config.task = ml_collections.ConfigDict(dict(cell["task"]))
  config.seed = seed
  config.model.mixer = mixer
  config.train.learning_rate = lr
  config.train.num_steps = cell["num_steps"]
  if "batch_size" in cell:
    config.train.batch_size = cell["batch_size"]
    config.train.eval_batch_size = cell["batch_size"]
  if "length_curriculum" in cell:
    config.train.length_curriculum = tuple(
        tuple(stage) for stage in cell["length_curriculum"])
  config.lock()
  variant = sweep.get("variants", {}).get(mixer)
  if variant is not None:  # on the locked config: a misspelt field raises
    try:
      config.update_from_flattened_dict(dict(variant))
    except (KeyError, AttributeError) as e:
      raise ValueError(f"sweep.variants[{mixer!r}]: the config has no field"
                       f" {e}.") from None
  task, seq_len = cell["task"]["name"], cell["task"]["seq_len"]
  return Run(name=run_name(task, seq_len, mixer, seed, lr), task=task,
             seq_len=seq_len, mixer=mixer, seed=seed, learning_rate=lr,
             config=config)


def validate_sweep(sweep) -> None:
  """Raises ValueError naming the first bad field of a sweep config."""
  for field in ("base", "cells", "mixers", "seeds"):
    if field not in sweep:
      raise ValueError(
          f"the config is not a sweep config (it has no field {field!r}): a"
          " sweep config holds an experiment config as `base`, the `cells`"
          " (task, length, steps) and the `mixers` and `seeds` crossed with"
          " them; the sweeps are configs/sweeps/*.py, and one experiment"
          " config runs with run_experiment.py.")
  for field in ("cells", "mixers", "seeds"):
    if not sweep[field]:
      raise ValueError(f"sweep.{field} must be non-empty.")
  if not sweep.get("learning_rates") and not all(
      c.get("learning_rates") for c in sweep.cells):
    raise ValueError("sweep.learning_rates must be non-empty unless every"
                     " cell has its own 'learning_rates'.")
  seen = set()
  for i, cell in enumerate(sweep.cells):
    if not {"task", "num_steps"} <= set(cell):
      raise ValueError(f"sweep.cells[{i}] must have 'task' and 'num_steps';"
                       f" got {sorted(cell)}.")
    key = (cell["task"].get("name"), cell["task"].get("seq_len"))
    if key in seen:
      raise ValueError(f"sweep.cells[{i}] repeats the cell {key}.")
    seen.add(key)
  if len(set(sweep.seeds)) != len(sweep.seeds):
    raise ValueError(f"sweep.seeds must be distinct; got {sweep.seeds}.")
  for i, cell in enumerate(sweep.cells):
    for field, rates in (("sweep.learning_rates",
                          sweep.get("learning_rates") or ()),
                         (f"sweep.cells[{i}]['learning_rates']",
                          cell.get("learning_rates", ()))):
      if isinstance(rates, (tuple, list)):
        continue
      missing = [m for m in sweep.mixers if not rates.get(m)]
      if missing:
        raise ValueError(f"{field} must give rates for every mixer; missing"
                         f" {missing}.")
  for name, variant in sweep.get("variants", {}).items():
    if "model.mixer" not in dict(variant):
      raise ValueError(f"sweep.variants[{name!r}] must set 'model.mixer'.")


def learning_rates(sweep, mixer: str, cell=None) -> tuple[float, ...]:
  """The rates `mixer` runs at in `cell`: the cell's `learning_rates` if it
  has them, else sweep.learning_rates (each shared or per mixer)."""
  rates = (cell or {}).get("learning_rates") or sweep.get("learning_rates")
  return tuple(rates if isinstance(rates, (tuple, list)) else rates[mixer])


def expand(sweep) -> list[Run]:
  """Every run of the sweep, seeds outermost (all cells of seed 0 first).

  Seeds outermost means a sweep stopped half way has every cell covered by
  its first seeds, not some cells with all seeds and others with none.
  """
  validate_sweep(sweep)
  runs = []
  for seed in sweep.seeds:
    for cell in sorted(sweep.cells, key=lambda c: c["task"]["seq_len"]):
      for mixer in sweep.mixers:
        for lr in learning_rates(sweep, mixer, cell):
          runs.append(_run(sweep, cell, mixer, seed, lr))
  ablation = sweep.get("ablation")
  if ablation:
    for seed in ablation["seeds"]:
      for cell in sweep.cells:
        if cell["task"]["seq_len"] == ablation["seq_len"]:
          runs.append(_run(sweep, cell, ablation["mixer"], seed,
                           learning_rates(sweep, sweep.mixers[0], cell)[0]))
  for run in runs:
    train.validate_config(run.config)
  return runs


def select(runs: Sequence[Run], only: str | None) -> list[Run]:
  """The runs whose name contains `only` (every run for None); ValueError
  when none does, naming a few of the runs there are."""
  if only is None:
    return list(runs)
  chosen = [r for r in runs if only in r.name]
  if not chosen:
    cells = sorted({r.name.split("/")[0] + "/" for r in runs})
    raise ValueError(
        f"no run of the sweep matches {only!r}: run names are"
        f" <task>_T<length>/<mixer>_seed<s>_lr<rate>, here in the cells"
        f" {', '.join(cells[:6])}{' ...' if len(cells) > 6 else ''}.")
  return chosen


def is_done(run_dir: str, config=None) -> bool:
  """Diverged, or finished (for `config`: reached its stop_at_accuracy or
  trained its num_steps; a run extended past them is done too)."""
  if os.path.exists(os.path.join(run_dir, "error.json")):
    return True
  path = os.path.join(run_dir, "summary.json")
  if not os.path.exists(path):
    return False
  if config is None:
    return True
  with open(path) as f:
    return resume.is_finished(json.load(f), config)


def progress(run_dir: str) -> str:
  """Where a run stands, from its files: "" if it has not started, else
  "step S: held-out A% (best B%), <state>".

  <state> is "diverged" (error.json), the summary's status (solved,
  plateaued, rising at cap), "training" (a live process holds its lock) or
  "stopped" (killed or paused between checkpoints; the next sweep resumes
  it).
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  records = metrics_lib.read_records(path) if os.path.exists(path) else []
  evals = [r for r in records if r["split"] == "eval"]
  if os.path.exists(os.path.join(run_dir, "error.json")):
    state = "diverged"
  elif os.path.exists(os.path.join(run_dir, "summary.json")):
    with open(os.path.join(run_dir, "summary.json")) as f:
      state = json.load(f).get("status") or "finished"
  else:
    owner = run_lock.read(run_dir + run_lock.SUFFIX)
    state = ("training" if owner is not None and not run_lock.is_dead(owner)
             else "stopped")
  if not evals:
    return "" if state == "stopped" else state
  last = evals[-1]
  return (f"step {last['step']}: held-out {100 * last['accuracy']:.1f}%"
          f" (best {100 * max(r['accuracy'] for r in evals):.1f}%), {state}")


def extend(runs: Sequence[Run], num_steps: int) -> list[Run]:
  """The runs with train.num_steps raised to at least `num_steps`.

  Only for schedules that extend (resume.EXTENDABLE_SCHEDULES): a finished
  run that did not reach stop_at_accuracy then resumes from its checkpoint.
  """
  check_extendable(runs)
  out = []
  for run in runs:
    config = copy.deepcopy(run.config)
    config.train.num_steps = max(run.config.train.num_steps, num_steps)
    out.append(dataclasses.replace(run, config=config))
  return out


def check_extendable(runs: Sequence[Run]) -> None:
  """Raises ValueError unless every run's schedule extends."""
  for run in runs:
    if run.config.train.schedule not in resume.EXTENDABLE_SCHEDULES:
      raise ValueError(
          f"extend_to needs train.schedule in {resume.EXTENDABLE_SCHEDULES}"
          f" (only those extend: a {run.config.train.schedule!r} rate at"
          f" every step depends on train.num_steps); {run.name} has"
          f" {run.config.train.schedule!r}: train longer runs of it in a new"
          " workdir instead.")


def extend_rising(runs: Sequence[Run], workdir: str, step: int,
                  max_steps: int) -> list[Run]:
  """The runs, with the step cap of those still learning raised by `step`
  (to at most `max_steps`): a sweep's steps go where its runs still learn.

  A run finished still learning at its cap (`metrics.LEARNING`: "rising at
  cap", or "falling at cap" under the loss rule), read from its metrics by
  `metrics.run_status` with its config's `train.status_rule` (the rule of
  this code, not the one its summary was written with), below `max_steps`
  gets train.num_steps = min(steps + `step`, `max_steps`); a run whose config.json asks for more steps than its
  summary holds (an extension killed before it finished) gets that cap back;
  every other run (solved, plateaued, diverged, unfinished, at `max_steps`)
  is returned as given. Run repeatedly (`run_sweep`'s `extend_step`), a run
  continues `step` steps at a time until solved, plateaued or at
  `max_steps`.
  """
  if isinstance(step, bool) or not isinstance(step, int) or step < 1:
    raise ValueError(f"extend_step must be an int >= 1; got {step!r}.")
  out = []
  for run in runs:
    run_dir = os.path.join(workdir, run.name)
    path = os.path.join(run_dir, "summary.json")
    if (os.path.exists(os.path.join(run_dir, "error.json"))
        or not os.path.exists(path)):
      out.append(run)
      continue
    with open(path) as f:
      summary = json.load(f)
    stored = resume.stored_config(run_dir) or {}
    asked = stored.get("train", {}).get("num_steps", 0)
    steps = summary["steps"]
    status = summary.get("status")
    records = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(records):
      status = metrics_lib.run_status(
          metrics_lib.read_records(records),
          rule=run.config.train.get("status_rule", "accuracy"))
    stop_at = run.config.train.stop_at_accuracy
    best = summary.get("best_eval_accuracy")
    if stop_at is not None and best is not None and best >= stop_at:
      target = None
    elif asked > steps:  # an extension killed before it finished
      target = asked
    elif status in metrics_lib.LEARNING and steps < max_steps:
      target = min(steps + step, max_steps)
    else:
      target = None
    out.append(run if target is None else extend([run], target)[0])
  return out


def check_workdir(runs: Sequence[Run], workdir: str) -> None:
  """Raises ValueError if a run directory holds a run of another config.

  A sweep config edited after some runs finished would otherwise count
  those runs (or resume their checkpoints) as runs of the edited config.
  """
  stale = []
  for run in runs:
    diff = resume.config_differences(os.path.join(workdir, run.name),
                                     run.config)
    if diff:
      stale.append(f"{run.name} ({'; '.join(diff)})")
  if stale:
    more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
    raise ValueError(
        f"workdir {workdir} holds runs of a different config than the"
        f" sweep's: {', '.join(stale[:3])}{more}. Use a new workdir for the"
        " edited sweep, or remove those runs to retrain them.")


COMMITS_FILE = "commits.txt"


def record_commit(run_dir: str, code_version: str, *,
                  from_scratch: bool = False) -> None:
  """Appends `code_version` to the run's commits.txt unless it is the last.

  A run resumed at another commit lists both, in order. A run that trains
  again from step 0 (`from_scratch`: it has no checkpoint, e.g. a committed
  run extended) starts a new list: none of its steps are the old code's.
  """
  path = os.path.join(run_dir, COMMITS_FILE)
  known = [] if from_scratch else read_commits(run_dir)
  if known and known[-1] == code_version:
    return
  os.makedirs(run_dir, exist_ok=True)
  metrics_lib.write_atomic(path, "".join(c + "\n"
                                         for c in known + [code_version]))


def read_commits(run_dir: str) -> list[str]:
  path = os.path.join(run_dir, COMMITS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [line.strip() for line in f if line.strip()]


def run_sweep(sweep, workdir: str, *, only: str | None = None,
              code_version: str | None = None,
              extend_to: int | None = None,
              extend_step: int | None = None,
              depth_first: bool = False) -> list[Run]:
  """Trains every unfinished run (whose name contains `only`, if given).

  With `extend_to`, a run's step cap is raised to at least that many steps
  (`extend`), so every selected run that did not reach its
  stop_at_accuracy continues to it. With `extend_step` too, only the runs
  still learning at their cap (rising, or with the loss rule falling)
  continue, `extend_step` steps at a time (`extend_rising`), until each is
  solved, plateaued (or converged) or at `extend_to`;
  the runs not yet trained to their sweep's cap train to it first. With
  `depth_first` too, each run is taken to its end (first pass and every
  extension) before the next starts: a sweep stopped part way (a session's
  end) leaves whole runs, and at most one run per process unfinished.

  A run whose training fails with non-finite gradients is recorded as
  `error.json` in its directory (a divergence is a result, not a crash of
  the sweep); any other error stops the sweep. With `code_version` (the
  commit of the code), each run it trains records it in its commits.txt.
  Returns the runs this process trained.
  """
  runs = select(expand(sweep), only)
  if extend_step is not None:
    if extend_to is None:
      raise ValueError("extend_step needs extend_to (the most steps a run"
                       " is extended to).")
    check_extendable(runs)  # before any first pass, not after
    check_workdir(runs, workdir)
    if depth_first:
      return [done for run in runs for done in _train_to_the_end(
          [run], workdir, code_version, extend_step, extend_to)]
    return _train_to_the_end(runs, workdir, code_version, extend_step,
                             extend_to)
  if depth_first:
    raise ValueError("depth_first needs extend_step (without it every run"
                     " trains one pass to its cap, in order).")
  if extend_to is not None:
    runs = extend(runs, extend_to)
  check_workdir(runs, workdir)
  return _train_unfinished(runs, workdir, code_version)


def _train_to_the_end(runs: Sequence[Run], workdir: str,
                      code_version: str | None, step: int,
                      max_steps: int) -> list[Run]:
  """First passes of `runs`, then rounds of `extend_rising` until none of
  them is left to train (or what is left is another process's)."""
  trained = _train_unfinished(runs, workdir, code_version)
  while True:  # each round re-reads the statuses its runs finished with
    extended = extend_rising(runs, workdir, step, max_steps)
    done_now = _train_unfinished(extended, workdir, code_version)
    trained += done_now
    if not done_now:
      return trained


def _train_unfinished(runs: Sequence[Run], workdir: str,
                      code_version: str | None) -> list[Run]:
  """Trains the runs not done (`is_done`) that this process can claim."""
  todo = [r for r in runs
          if not is_done(os.path.join(workdir, r.name), r.config)]
  logging.info("Sweep: %d runs, %d done, %d to do.", len(runs),
               len(runs) - len(todo), len(todo))
  trained, t0 = [], time.time()
  for i, run in enumerate(todo):
    run_dir = os.path.join(workdir, run.name)
    if is_done(run_dir, run.config) or not run_lock.claim(run_dir):
      continue  # finished or being trained by another process
    try:
      if is_done(run_dir, run.config):  # finished since the check
        continue
      logging.info("Sweep run %d/%d: %s", i + 1, len(todo), run.name)
      if code_version:
        record_commit(run_dir, code_version,
                      from_scratch=not checkpoints.has_checkpoint(run_dir))
      try:
        with run_lock.Lease(run_dir):
          train.train_and_evaluate(run.config, run_dir)
      except FloatingPointError as e:
        logging.warning("Run %s diverged: %s", run.name, e)
        metrics_lib.write_atomic(os.path.join(run_dir, "error.json"),
                                 json.dumps(dict(error=str(e))))
      # The run's compiled programs go: each holds memory maps (about a
      # thousand for a smoke run on a CPU), and a process that kept every
      # run's would meet the kernel's limit on them (65,530 by default on
      # Linux; XLA dies in its next compile there) within a long sweep.
      jax.clear_caches()
      trained.append(run)
      elapsed = time.time() - t0
      logging.info("Sweep: %d runs trained by this process in %.0f s.",
                   len(trained), elapsed)
    finally:
      run_lock.release(run_dir)
  return trained
