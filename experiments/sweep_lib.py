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
  (rates chosen per mixer);
* `variants` (optional): `{name: ((dotted field, value), ...)}`, a named
  model variant, e.g. `kda_negeig: (("model.mixer", "kda"),
  ("model.kda.allow_neg_eigval", True))` (configs/sweeps/parity.py);
* `ablation`: `dict(mixer=..., seq_len=..., seeds=...)`, extra runs of one
  mixer (e.g. `kda_zeroed`) on the cells of that length, at the first
  mixer's first learning rate.

`expand(sweep)` lists the runs; `run_sweep` trains every run that is not
finished (no `summary.json`, or with `extend_to` a raised step cap) into `<workdir>/<task>_T<len>/<mixer>_seed<s>_lr<lr>/`
(each an ordinary, resumable run directory), so a killed sweep continues
where it stopped; a run directory that holds a run of a different config
(the sweep config was edited) stops the sweep and its aggregation with a
ValueError naming the runs and fields. Several processes may work on one
workdir at once, on one host or several sharing it: each run is claimed
through `<run dir>.lock` (experiments/run_lock.py: host, pid and a lease
the trainer refreshes; taken over only when its owner is provably gone).

Each run directory also gets `commits.txt`, the commit(s) of the code that
trained it (one line per commit, in order, when a run was resumed at
another), passed in by the CLI; results.md says how many runs each commit
trained.

`aggregate(sweep, workdir)` writes `results.json` (every run summary and one
record per cell), `results.md` (one row per (task, length, mixer): mean, min
and max over seeds of the best held-out accuracy and of the steps to 99%,
the runs' statuses (`metrics.run_status`: solved, plateaued or rising at
cap); per cell, the first mixer's per-seed difference from each other one
with a verdict (`compare`); one row per run;
with `train.eval_lengths`, a second table of the final parameters' accuracy
at each evaluation length, and `length_generalisation.png`) and two
figures: `accuracy_vs_length.png` (per task, mean with a min-max
band over seeds) and `curves_T<len>.png` (held-out accuracy against step at
one length, mean and band). With several learning rates a cell reports the
rate whose mean best accuracy over seeds is highest (the protocol of
Kimi Linear §5.1, best of a learning-rate grid), with every rate's runs kept
in results.json.
"""

import copy
import dataclasses
import json
import os
import time
from typing import Any, Sequence

from absl import logging
import ml_collections
import numpy as np

from experiments import metrics as metrics_lib
from experiments import plotting
from experiments import run_lock
from experiments import train


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
  for field in ("base", "cells", "mixers", "seeds", "learning_rates"):
    if field not in sweep:
      raise ValueError(f"the sweep config needs a field {field!r}.")
  for field in ("cells", "mixers", "seeds", "learning_rates"):
    if not sweep[field]:
      raise ValueError(f"sweep.{field} must be non-empty.")
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
  if not isinstance(sweep.learning_rates, (tuple, list)):
    missing = [m for m in sweep.mixers if not sweep.learning_rates.get(m)]
    if missing:
      raise ValueError(f"sweep.learning_rates must give rates for every mixer;"
                       f" missing {missing}.")
  for name, variant in sweep.get("variants", {}).items():
    if "model.mixer" not in dict(variant):
      raise ValueError(f"sweep.variants[{name!r}] must set 'model.mixer'.")


def learning_rates(sweep, mixer: str) -> tuple[float, ...]:
  """The rates `mixer` runs at (sweep.learning_rates, shared or per mixer)."""
  rates = sweep.learning_rates
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
        for lr in learning_rates(sweep, mixer):
          runs.append(_run(sweep, cell, mixer, seed, lr))
  ablation = sweep.get("ablation")
  if ablation:
    for seed in ablation["seeds"]:
      for cell in sweep.cells:
        if cell["task"]["seq_len"] == ablation["seq_len"]:
          runs.append(_run(sweep, cell, ablation["mixer"], seed,
                           learning_rates(sweep, sweep.mixers[0])[0]))
  for run in runs:
    train.validate_config(run.config)
  return runs


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
    return train.is_finished(json.load(f), config)


def extend(runs: Sequence[Run], num_steps: int) -> list[Run]:
  """The runs with train.num_steps raised to at least `num_steps`.

  Only for schedules that extend (train.EXTENDABLE_SCHEDULES): a finished
  run that did not reach stop_at_accuracy then resumes from its checkpoint.
  """
  out = []
  for run in runs:
    tr = run.config.train
    if tr.schedule not in train.EXTENDABLE_SCHEDULES:
      raise ValueError(
          f"extend_to needs train.schedule in {train.EXTENDABLE_SCHEDULES};"
          f" {run.name} has {tr.schedule!r}.")
    config = copy.deepcopy(run.config)
    config.train.num_steps = max(tr.num_steps, num_steps)
    out.append(dataclasses.replace(run, config=config))
  return out


def check_workdir(runs: Sequence[Run], workdir: str) -> None:
  """Raises ValueError if a run directory holds a run of another config.

  A sweep config edited after some runs finished would otherwise count
  those runs (or resume their checkpoints) as runs of the edited config.
  """
  stale = []
  for run in runs:
    diff = train.config_differences(os.path.join(workdir, run.name),
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


def record_commit(run_dir: str, code_version: str) -> None:
  """Appends `code_version` to the run's commits.txt unless it is the last.

  A run resumed at another commit lists both, in order.
  """
  path = os.path.join(run_dir, COMMITS_FILE)
  known = read_commits(run_dir)
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
              extend_to: int | None = None) -> list[Run]:
  """Trains every unfinished run (whose name contains `only`, if given).

  With `extend_to`, a run's step cap is raised to at least that many steps
  (`extend`), so every selected run that did not reach its
  stop_at_accuracy continues to it.

  A run whose training fails with non-finite gradients is recorded as
  `error.json` in its directory (a divergence is a result, not a crash of
  the sweep); any other error stops the sweep. With `code_version` (the
  commit of the code), each run it trains records it in its commits.txt.
  Returns the runs this process trained.
  """
  runs = [r for r in expand(sweep) if only is None or only in r.name]
  if not runs:
    raise ValueError(f"no run of the sweep matches {only!r}.")
  if extend_to is not None:
    runs = extend(runs, extend_to)
  check_workdir(runs, workdir)
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
        record_commit(run_dir, code_version)
      try:
        with run_lock.Lease(run_dir), train.backend_context(run.config):
          train.train_and_evaluate(run.config, run_dir)
      except FloatingPointError as e:
        logging.warning("Run %s diverged: %s", run.name, e)
        metrics_lib.write_atomic(os.path.join(run_dir, "error.json"),
                                 json.dumps(dict(error=str(e))))
      trained.append(run)
      elapsed = time.time() - t0
      logging.info("Sweep: %d runs trained by this process in %.0f s.",
                   len(trained), elapsed)
    finally:
      run_lock.release(run_dir)
  return trained


def _read_run(run_dir: str, cap: int) -> dict[str, Any] | None:
  """The run's summary plus its eval curve, or None when not finished.

  Its status (`metrics.run_status`, or "diverged"), training seconds over
  every resume and step cap (config.json's, else `cap`) come from its
  metrics and config, so runs written before the summary had them read the
  same way.
  """
  records = []
  path = os.path.join(run_dir, "metrics.jsonl")
  if os.path.exists(path):
    records = metrics_lib.read_records(path)
  evals = [r for r in records if r["split"] == "eval"]
  summary_path = os.path.join(run_dir, "summary.json")
  error_path = os.path.join(run_dir, "error.json")
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  elif os.path.exists(error_path):
    with open(error_path) as f:
      summary = dict(error=json.load(f)["error"],
                     best_eval_accuracy=max(
                         (r["accuracy"] for r in evals), default=None),
                     steps_to_99=None, wall_seconds=None)
  else:
    return None
  summary["status"] = ("diverged" if "error" in summary
                       else metrics_lib.run_status(records))
  summary["train_seconds"] = metrics_lib.train_seconds(records)
  stored = train.stored_config(run_dir)
  summary["num_steps"] = cap if stored is None else stored["train"][
      "num_steps"]
  summary["commits"] = read_commits(run_dir)
  summary["eval_steps"] = [r["step"] for r in evals]
  summary["eval_accuracy"] = [r["accuracy"] for r in evals]
  return summary


def _stats(values: Sequence[float]) -> dict[str, float] | None:
  if not values:
    return None
  return dict(mean=float(np.mean(values)), min=float(np.min(values)),
              max=float(np.max(values)))


def aggregate(sweep, workdir: str, *,
              metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  """Writes results.json, results.md and the figures; returns the results.

  Covers the finished runs only; a cell lists how many seeds it has, so a
  partial sweep's tables say what is missing.
  """
  runs = expand(sweep)
  check_workdir(runs, workdir)
  found = []
  for run in runs:
    summary = _read_run(os.path.join(workdir, run.name),
                        run.config.train.num_steps)
    if summary is not None:
      found.append((run, summary))
  cells: dict[tuple, dict[float, list]] = {}
  for run, summary in found:
    key = (run.task, run.seq_len, run.mixer)
    cells.setdefault(key, {}).setdefault(run.learning_rate, []).append(
        (run, summary))
  records = []
  for (task, seq_len, mixer), by_lr in cells.items():
    def mean_best(items):
      return np.mean([s["best_eval_accuracy"] or 0.0 for _, s in items])
    lr = max(by_lr, key=lambda x: (mean_best(by_lr[x]), -x))
    items = sorted(by_lr[lr], key=lambda rs: rs[0].seed)
    best = [s["best_eval_accuracy"] for _, s in items
            if s["best_eval_accuracy"] is not None]
    reached = [s["steps_to_99"] for _, s in items
               if s["steps_to_99"] is not None]
    records.append(dict(
        task=task, seq_len=seq_len, mixer=mixer, learning_rate=lr,
        seeds=[r.seed for r, _ in items], best_accuracy=_stats(best),
        steps_to_99=_stats(reached), num_reached_99=len(reached),
        num_diverged=sum("error" in s for _, s in items),
        chance_accuracy=next((s.get("chance_accuracy") for _, s in items
                              if s.get("chance_accuracy") is not None), None),
        best_by_seed={r.seed: s["best_eval_accuracy"] for r, s in items},
        statuses={st: n for st in metrics_lib.STATUSES + ("diverged",)
                  if (n := sum(s["status"] == st for _, s in items))},
        num_steps=max(s["num_steps"] for _, s in items),
        length_curriculum=[list(stage) for stage in items[0][0].config.train
                           .get("length_curriculum", ())],
        train_seconds=float(sum(s["train_seconds"] for _, s in items)),
        length_accuracy=_length_stats(s for _, s in items),
    ))
  order = {m: i for i, m in enumerate(
      list(sweep.mixers) + [sweep.get("ablation", {}).get("mixer")])}
  records.sort(key=lambda r: (r["task"], r["seq_len"], order.get(r["mixer"],
                                                                 99)))
  results = dict(
      sweep=sweep.get("name", "sweep"),
      metadata=metadata or {},
      num_runs=len(runs), num_finished=len(found),
      train_seconds=float(sum(s["train_seconds"] for _, s in found)),
      cells=records,
      comparisons=compare(records, sweep.mixers),
      runs=[dict(name=r.name, **{k: v for k, v in s.items()})
            for r, s in found])
  os.makedirs(workdir, exist_ok=True)
  metrics_lib.write_atomic(os.path.join(workdir, "results.json"),
                           json.dumps(results, indent=1))
  metrics_lib.write_atomic(os.path.join(workdir, "results.md"),
                           results_markdown(results))
  if records:
    plot_sweep(results, sweep, workdir)
  return results


def compare(cells: Sequence[dict[str, Any]],
            mixers: Sequence[str]) -> list[dict[str, Any]]:
  """Per (task, length): the first mixer against each other one, by seed.

  The per-seed difference of best held-out accuracy (the seeds both have),
  its mean, min and max, and a verdict: "ahead in every seed", "behind in
  every seed", "both solve in every seed" (then steps to 99% tell them
  apart), or "mixed".
  """
  by_key = {(c["task"], c["seq_len"], c["mixer"]): c for c in cells}
  out = []
  for (task, seq_len, mixer), first in by_key.items():
    if mixer != mixers[0]:
      continue
    for other in mixers[1:]:
      second = by_key.get((task, seq_len, other))
      if second is None:
        continue
      seeds = sorted(set(first["best_by_seed"]) & set(second["best_by_seed"]))
      a = [first["best_by_seed"][s] or 0.0 for s in seeds]
      b = [second["best_by_seed"][s] or 0.0 for s in seeds]
      diff = [x - y for x, y in zip(a, b)]
      if not diff:
        continue
      if min(a + b) >= metrics_lib.TARGET_ACCURACY:
        verdict = "both solve in every seed"
      elif min(diff) > 0:
        verdict = "ahead in every seed"
      elif max(diff) < 0:
        verdict = "behind in every seed"
      else:
        verdict = "mixed"
      out.append(dict(task=task, seq_len=seq_len, mixer=mixer, other=other,
                      seeds=seeds, difference=_stats(diff), verdict=verdict))
  return sorted(out, key=lambda c: (c["task"], c["seq_len"], c["other"]))


def _length_stats(summaries) -> dict[str, dict[str, float]] | None:
  """{length: stats over seeds} of summary.json's `length_accuracy`."""
  by_len: dict[str, list[float]] = {}
  for s in summaries:
    for n, acc in (s.get("length_accuracy") or {}).items():
      by_len.setdefault(n, []).append(acc)
  if not by_len:
    return None
  return {n: dict(_stats(v), count=len(v))
          for n, v in sorted(by_len.items(), key=lambda kv: int(kv[0]))}


def _pct(stats, key) -> str:
  return "-" if stats is None else f"{100 * stats[key]:.1f}"


def _stages(curriculum) -> str:
  """' (300 at T=256 first)' for a length curriculum; '' for none."""
  if not curriculum:
    return ""
  return " (" + ", ".join(f"{steps} at T={n}" for steps, n in curriculum) + (
      " first)")


def results_markdown(results: dict[str, Any]) -> str:
  """One row per (task, length, mixer): seeds' mean [min, max]."""
  meta = results["metadata"]
  lines = [f"# {results['sweep']}: best held-out accuracy over seeds", ""]
  if meta:
    lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
  trained_at: dict[str, int] = {}
  for run in results.get("runs", ()):
    for commit in run.get("commits") or ["(not recorded)"]:
      trained_at[commit] = trained_at.get(commit, 0) + 1
  if trained_at:
    lines += ["Runs trained at: " + ", ".join(
        f"{c} ({n} run{'s' if n > 1 else ''})"
        for c, n in trained_at.items()) + ".", ""]
  lines += [
      f"{results['num_finished']} of {results['num_runs']} runs finished;"
      f" {results['train_seconds'] / 3600:.2f} hours of training, summed"
      " over runs from their metrics (every resumed part included).", "",
      "Status of a run, from its metrics: solved (>= 99%), plateaued (held-out"
      " accuracy rising < 0.5 points per 100 steps over the last 300 steps at"
      " >= half the peak rate), rising at cap (anything else).", "",
      "| task | T | mixer | lr | seeds | best acc % mean [min, max] |"
      " reached 99% | steps to 99% mean [min, max] | step cap | status |"
      " chance % |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results["cells"]:
    acc = r["best_accuracy"]
    steps = r["steps_to_99"]
    acc_s = ("-" if acc is None else
             f"{_pct(acc, 'mean')} [{_pct(acc, 'min')}, {_pct(acc, 'max')}]")
    steps_s = ("-" if steps is None else
               f"{steps['mean']:.0f} [{steps['min']:.0f}, {steps['max']:.0f}]")
    chance = r["chance_accuracy"]
    lines.append(
        f"| {r['task']} | {r['seq_len']} | {r['mixer']} |"
        f" {r['learning_rate']:g} | {len(r['seeds'])} | {acc_s} |"
        f" {r['num_reached_99']}/{len(r['seeds'])} | {steps_s} |"
        f" {r['num_steps']}{_stages(r.get('length_curriculum'))} |"
        f" {_statuses(r.get('statuses'))} |"
        f" {'-' if chance is None else f'{100 * chance:.1f}'} |")
  lines += _comparison_lines(results.get("comparisons", ()))
  with_lengths = [r for r in results["cells"] if r.get("length_accuracy")]
  if with_lengths:
    lengths = sorted({int(n) for r in with_lengths
                      for n in r["length_accuracy"]})
    lines += [
        "", "## Length generalisation: final parameters' held-out accuracy %"
        " at each length, mean [min, max] over seeds", "",
        "| task | T trained | mixer | seeds | "
        + " | ".join(f"T={n}" for n in lengths) + " |",
        "|---|---|---|---|" + "---|" * len(lengths)]
    for r in with_lengths:
      acc = r["length_accuracy"]
      cols = [("-" if str(n) not in acc else
               f"{_pct(acc[str(n)], 'mean')} [{_pct(acc[str(n)], 'min')},"
               f" {_pct(acc[str(n)], 'max')}]") for n in lengths]
      lines.append(f"| {r['task']} | {r['seq_len']} | {r['mixer']} |"
                   f" {len(r['seeds'])} | " + " | ".join(cols) + " |")
  lines += _run_lines(results.get("runs", ()))
  return "\n".join(lines) + "\n"


def _statuses(statuses) -> str:
  """'2 solved, 1 rising at cap' (or '-' for runs that predate it)."""
  return ", ".join(f"{n} {st}" for st, n in (statuses or {}).items()) or "-"


def _comparison_lines(comparisons) -> list[str]:
  if not comparisons:
    return []
  lines = ["", "## Per-seed differences of best held-out accuracy", "",
           "| task | T | pair | seeds | difference, points: mean [min, max] |"
           " verdict |", "|---|---|---|---|---|---|"]
  for c in comparisons:
    d = c["difference"]
    lines.append(
        f"| {c['task']} | {c['seq_len']} | {c['mixer']} - {c['other']} |"
        f" {len(c['seeds'])} | {100 * d['mean']:+.1f} [{100 * d['min']:+.1f},"
        f" {100 * d['max']:+.1f}] | {c['verdict']} |")
  return lines


def _run_lines(runs) -> list[str]:
  if not runs:
    return []
  lines = ["", "## Runs", "", "| run | steps | step cap | best acc % |"
           " status | training minutes |", "|---|---|---|---|---|---|"]
  for r in runs:
    best = r.get("best_eval_accuracy")
    lines.append(
        f"| {r['name']} | {r.get('steps', '-')} | {r['num_steps']} |"
        f" {'-' if best is None else f'{100 * best:.1f}'} | {r['status']} |"
        f" {r['train_seconds'] / 60:.1f} |")
  return lines


def _curve_on_grid(steps, accs, grid):
  """A run's eval curve on `grid`; after an early stop it holds its last value.

  A run stops once it reaches the target accuracy, so holding its last
  value is what it would have kept (within evaluation noise).
  """
  if not steps:
    return np.full(len(grid), np.nan)
  out = np.interp(grid, steps, accs)
  out[np.asarray(grid) > steps[-1]] = accs[-1]
  return out


def plot_length_generalisation(results: dict[str, Any], mixers,
                               path: str) -> bool:
  """Accuracy vs evaluation length, one panel per trained cell; False if
  no run has `length_accuracy`."""
  cells = [c for c in results["cells"] if c.get("length_accuracy")]
  if not cells:
    return False
  series, chance = {}, {}
  for c in cells:
    panel = f"{c['task']} trained at T={c['seq_len']}"
    acc = c["length_accuracy"]
    xs = [int(n) for n in acc]
    series[(panel, c["mixer"])] = (
        xs, [acc[n]["mean"] for n in acc], [acc[n]["min"] for n in acc],
        [acc[n]["max"] for n in acc], [acc[n]["count"] for n in acc])
    chance[panel] = c["chance_accuracy"]
  plotting.plot_bands_by_task(
      series, tasks=list(dict.fromkeys(p for p, _ in series)), mixers=mixers,
      chance=chance, log_x=True, xlabel="evaluation length T",
      ylabel="held-out accuracy (%)",
      title="final parameters at longer lengths (mean, band: min-max over"
      " seeds)", path=path)
  return True


def plot_sweep(results: dict[str, Any], sweep, workdir: str) -> None:
  """accuracy_vs_length.png, curves_T<len>.png for the curve length and,
  with evaluation lengths, length_generalisation.png."""
  cells = results["cells"]
  tasks = sorted({c["task"] for c in cells})
  mixers = [m for m in list(sweep.mixers) + [
      sweep.get("ablation", {}).get("mixer")] if m]
  plot_length_generalisation(
      results, mixers, os.path.join(workdir, "length_generalisation.png"))
  series, rising = {}, {}
  for task in tasks:
    for mixer in mixers:
      rows = sorted((c for c in cells
                     if c["task"] == task and c["mixer"] == mixer
                     and c["best_accuracy"] is not None),
                    key=lambda c: c["seq_len"])
      if rows:
        rising[(task, mixer)] = [
            metrics_lib.RISING in (c.get("statuses") or {}) for c in rows]
        series[(task, mixer)] = (
            [c["seq_len"] for c in rows],
            [c["best_accuracy"]["mean"] for c in rows],
            [c["best_accuracy"]["min"] for c in rows],
            [c["best_accuracy"]["max"] for c in rows],
            [len(c["seeds"]) for c in rows])
  chance = {c["task"]: c["chance_accuracy"] for c in cells}
  plotting.plot_bands_by_task(
      series, tasks=tasks, mixers=mixers, chance=chance, log_x=True,
      xlabel="sequence length T", ylabel="best held-out accuracy (%)",
      title="best held-out accuracy vs length (mean, band: min-max over"
      " seeds)", path=os.path.join(workdir, "accuracy_vs_length.png"),
      rising=rising)
  curve_len = sweep.get("curve_seq_len")
  if not curve_len:
    return
  runs_by_key = {}
  for run in results["runs"]:
    task_len, rest = run["name"].split("/")
    runs_by_key.setdefault((task_len, rest.rsplit("_seed", 1)[0],
                            rest.rsplit("_lr", 1)[1]), []).append(run)
  curves = {}
  for c in cells:
    if c["seq_len"] != curve_len:
      continue
    key = (cell_name(c["task"], c["seq_len"]), c["mixer"],
           f"{c['learning_rate']:g}")
    runs = runs_by_key.get(key, [])
    if not runs:
      continue
    last = max(r["eval_steps"][-1] for r in runs if r["eval_steps"])
    grid = np.unique(np.concatenate(
        [r["eval_steps"] for r in runs] + [[last]]))
    ys = np.stack([_curve_on_grid(r["eval_steps"], r["eval_accuracy"], grid)
                   for r in runs])
    curves[(c["task"], c["mixer"])] = (
        list(grid), list(np.nanmean(ys, 0)), list(np.nanmin(ys, 0)),
        list(np.nanmax(ys, 0)), [len(runs)] * len(grid))
  if curves:
    plotting.plot_bands_by_task(
        curves, tasks=tasks, mixers=mixers, chance=chance, log_x=False,
        xlabel="training step", ylabel="held-out accuracy (%)",
        title=f"held-out accuracy at T={curve_len} (mean, band: min-max over"
        " seeds)", path=os.path.join(workdir, f"curves_T{curve_len}.png"))
