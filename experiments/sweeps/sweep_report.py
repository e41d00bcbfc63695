"""The results of a sweep: tables, per-seed comparisons and figures.

`aggregate(sweep, workdir)` writes `results.json` (every run summary and one
record per cell), `results.md` (one row per (task, length, mixer): mean, min
and max over seeds of the best held-out accuracy and of the steps to 99%,
the runs' statuses (`metrics.run_status`: solved, plateaued or rising at
cap, or by the loss rule converged or falling at cap); per cell, every
pair of mixers' per-seed difference with a verdict, at equal steps (each
seed's pair at the shorter run's length) beside the runs as trained
(`compare`); the learning rates every run directory tried, per length and
seed (`rates_tried`); the runs still learning below the sweep's
`max_steps`, if it has one; one row per run;
with `train.eval_lengths`, a second table of the final parameters' accuracy
at each evaluation length, and `length_generalisation.png`; on a byte
corpus (`text`), a table of held-out bits per byte at the training length
and each evaluation length, with `bits_per_byte_vs_length.png`) and two
figures: `accuracy_vs_length.png` (per task, mean with a min-max
band over seeds) and `curves_T<len>.png` (held-out accuracy against step at
one length, mean and band). With several learning rates a cell reports the
rate whose mean best accuracy over seeds is highest (the protocol of
Kimi Linear §5.1, best of a learning-rate grid), with every rate's runs kept
in results.json.

Runs are read from their directories (experiments/sweeps/sweep_lib.py lays them
out); a run's status and training time come from its metrics. This module
gathers the numbers; `sweep_markdown` writes them as results.md and
`sweep_figures` draws the figures.
"""

import glob
import json
import math
import os
from typing import Any, Sequence

import numpy as np

from experiments import tasks as tasks_lib
from experiments.sweeps import sweep_figures
from experiments.sweeps import sweep_lib
from experiments.sweeps import sweep_markdown
from experiments.training import metrics as metrics_lib
from experiments.training import resume
from experiments.training import train


def _read_run(run_dir: str, cap: int,
              rule: str = "accuracy") -> dict[str, Any] | None:
  """The run's summary plus its eval curve, or None when not finished.

  Its status (`metrics.run_status` by `rule`, the config's
  train.status_rule, or "diverged"), training seconds over every resume and
  step cap (config.json's, else `cap`) come from its metrics and config, so
  runs written before the summary had them, or under another rule, read the
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
                       else metrics_lib.run_status(records, rule=rule))
  summary["status_rule"] = rule
  summary["train_seconds"] = metrics_lib.train_seconds(records)
  summary["pause_seconds"] = metrics_lib.pause_seconds(records)
  stored = resume.stored_config(run_dir)
  summary["num_steps"] = cap if stored is None else stored["train"][
      "num_steps"]
  summary["commits"] = sweep_lib.read_commits(run_dir)
  summary["eval_steps"] = [r["step"] for r in evals]
  summary["eval_accuracy"] = [r["accuracy"] for r in evals]
  summary["bits_per_byte"] = _bits_per_byte(summary)
  if summary["bits_per_byte"] is not None:  # the held-out curve, in bits
    summary["eval_bits"] = [r["loss"] / math.log(2) for r in evals]
  return summary


def _bits_per_byte(summary) -> dict[str, float] | None:
  """{length: held-out bits per byte} of a run on a byte corpus, else None.

  A task on a corpus (`text`, whose summary records the corpus) has one
  token a byte, so its loss in bits is bits per byte: the final evaluation
  at the training length, then each of `train.eval_lengths`.
  """
  if "corpus" not in summary or summary.get("final_eval_loss") is None:
    return None
  bits = {str(summary["seq_len"]): summary["final_eval_loss"] / math.log(2)}
  for n, loss in (summary.get("length_loss") or {}).items():
    bits[n] = loss / math.log(2)
  return dict(sorted(bits.items(), key=lambda kv: int(kv[0])))


def baseline_accuracy(config) -> float | None:
  """A task's memory-light baseline (`task.baseline_correct`, e.g. Stack's
  last push per stack) on the run's own held-out set, or None."""
  if not hasattr(tasks_lib.TASKS.get(config.task.name), "baseline_correct"):
    return None  # before building the task: a corpus task reads its files
  task = tasks_lib.make_task(**config.task.to_dict())
  return tasks_lib.baseline_accuracy(
      task, [tasks_lib.Batch(**b) for b in train.eval_set(config, task)])


def workdir_compute(workdir: str) -> dict[str, float]:
  """Training time of every run directory in `workdir`, finished or not.

  The sweep's own totals cover its finished runs; the compute a study spent
  also holds runs still training and runs of other configurations kept in
  the same workdir (a calibration). {runs, train_seconds, pause_seconds}.
  """
  out = dict(runs=0, train_seconds=0.0, pause_seconds=0.0)
  for path in sorted(glob.glob(os.path.join(workdir, "*", "*",
                                            "metrics.jsonl"))):
    records = metrics_lib.read_records(path)
    out["runs"] += 1
    out["train_seconds"] += metrics_lib.train_seconds(records)
    out["pause_seconds"] += metrics_lib.pause_seconds(records)
  return out


def rates_tried(workdir: str, mixers: Sequence[str]
                ) -> list[dict[str, Any]]:
  """Which learning rates every run directory in `workdir` tried, per
  (task, mixer, length) and seed: a calibration's or a check's runs beside
  the protocol's, so a table can say where a rate was tuned and where not.

  One record per (task, mixer) of `mixers`: `lengths` maps T to a list of
  groups, one per seed with several rates (`rates`, `seeds` [that seed],
  `steps`: the shortest of those runs' last evaluated steps, `best`: each
  rate's best held-out accuracy up to there) and one for the seeds that
  tried one rate only (`steps`, `best` None).
  """
  found: dict[tuple, dict[int, dict[float, tuple]]] = {}
  for path in sorted(glob.glob(os.path.join(workdir, "*", "*",
                                            "metrics.jsonl"))):
    cell, run = path.split(os.sep)[-3:-1]
    if "_T" not in cell or "_seed" not in run or "_lr" not in run:
      continue
    task, seq_len = cell.rsplit("_T", 1)
    mixer, rest = run.rsplit("_seed", 1)
    seed, lr = rest.split("_lr", 1)
    if mixer not in mixers:
      continue
    evals = [r for r in metrics_lib.read_records(path) if r["split"] == "eval"]
    if not evals:
      continue
    curve = ([r["step"] for r in evals], [r["accuracy"] for r in evals])
    found.setdefault((task, int(seq_len), mixer), {}).setdefault(
        int(seed), {})[float(lr)] = curve
  out: dict[tuple, dict[str, Any]] = {}
  for (task, seq_len, mixer), by_seed in sorted(found.items()):
    groups, single = [], {}
    for seed, by_lr in sorted(by_seed.items()):
      if len(by_lr) == 1:
        single.setdefault(next(iter(by_lr)), []).append(seed)
        continue
      steps = min(c[0][-1] for c in by_lr.values())
      rates = sorted(by_lr)
      groups.append(dict(seeds=[seed], rates=rates, steps=steps,
                         best=[best_up_to(by_lr[lr], steps) for lr in rates]))
    for lr, seeds in sorted(single.items()):
      groups.append(dict(seeds=seeds, rates=[lr], steps=None, best=None))
    record = out.setdefault((task, mixer), dict(task=task, mixer=mixer,
                                                lengths={}))
    record["lengths"][seq_len] = groups
  order = {m: i for i, m in enumerate(mixers)}
  return sorted(out.values(), key=lambda r: (r["task"], order[r["mixer"]]))


def _stats(values: Sequence[float]) -> dict[str, float] | None:
  if not values:
    return None
  return dict(mean=float(np.mean(values)), min=float(np.min(values)),
              max=float(np.max(values)))


def _cell_record(task, seq_len, mixer, by_lr) -> dict[str, Any]:
  """One cell of results.json: the best rate's runs (by mean best accuracy,
  the lower rate on a tie) summarised across their seeds; `by_lr` maps each
  rate to its (run, summary) pairs."""
  def mean_best(items):
    return np.mean([s["best_eval_accuracy"] or 0.0 for _, s in items])
  lr = max(by_lr, key=lambda x: (mean_best(by_lr[x]), -x))
  items = sorted(by_lr[lr], key=lambda rs: rs[0].seed)
  best = [s["best_eval_accuracy"] for _, s in items
          if s["best_eval_accuracy"] is not None]
  reached = [s["steps_to_99"] for _, s in items
             if s["steps_to_99"] is not None]
  return dict(
      task=task, seq_len=seq_len, mixer=mixer, learning_rate=lr,
      seeds=[r.seed for r, _ in items], best_accuracy=_stats(best),
      steps_to_99=_stats(reached), num_reached_99=len(reached),
      num_diverged=sum("error" in s for _, s in items),
      chance_accuracy=next((s.get("chance_accuracy") for _, s in items
                            if s.get("chance_accuracy") is not None), None),
      best_by_seed={r.seed: s["best_eval_accuracy"] for r, s in items},
      curves={r.seed: (s["eval_steps"], s["eval_accuracy"])
              for r, s in items},
      bits_by_seed={r.seed: dict(s["bits_per_byte"], steps=s["steps"],
                                 curve=(s["eval_steps"], s["eval_bits"]))
                    for r, s in items if s.get("bits_per_byte")},
      statuses={st: n for st in metrics_lib.STATUSES + ("diverged",)
                if (n := sum(s["status"] == st for _, s in items))},
      num_steps=max(s["num_steps"] for _, s in items),
      min_num_steps=min(s["num_steps"] for _, s in items),
      length_curriculum=[list(stage) for stage in items[0][0].config.train
                         .get("length_curriculum", ())],
      train_seconds=float(sum(s["train_seconds"] for _, s in items)),
      length_accuracy=_length_stats(s for _, s in items),
      bits_per_byte=_length_stats((s for _, s in items),
                                  key="bits_per_byte"),
      num_params=items[0][1].get("num_params"),
      baseline_accuracy=_stats([b for r, _ in items
                                if (b := baseline_accuracy(r.config))
                                is not None]),
  )


def aggregate(sweep, workdir: str, *,
              metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  """Writes results.json, results.md and the figures; returns the results.

  Covers the finished runs only; a cell lists how many seeds it has, so a
  partial sweep's tables say what is missing.
  """
  runs = sweep_lib.expand(sweep)
  sweep_lib.check_workdir(runs, workdir)
  found = []
  for run in runs:
    summary = _read_run(os.path.join(workdir, run.name),
                        run.config.train.num_steps,
                        run.config.train.get("status_rule", "accuracy"))
    if summary is not None:
      found.append((run, summary))
  cells: dict[tuple, dict[float, list]] = {}
  for run, summary in found:
    key = (run.task, run.seq_len, run.mixer)
    cells.setdefault(key, {}).setdefault(run.learning_rate, []).append(
        (run, summary))
  records = [_cell_record(task, seq_len, mixer, by_lr)
             for (task, seq_len, mixer), by_lr in cells.items()]
  curves = {(r["task"], r["seq_len"], r["mixer"], seed): curve
            for r in records for seed, curve in r.pop("curves").items()}
  order = {m: i for i, m in enumerate(
      list(sweep.mixers) + [sweep.get("ablation", {}).get("mixer")])}
  records.sort(key=lambda r: (r["task"], r["seq_len"], order.get(r["mixer"],
                                                                 99)))
  results = dict(
      sweep=sweep.get("name", "sweep"),
      metadata=metadata or {},
      num_runs=len(runs), num_finished=len(found),
      train_seconds=float(sum(s["train_seconds"] for _, s in found)),
      pause_seconds=float(sum(s["pause_seconds"] for _, s in found)),
      workdir_compute=workdir_compute(workdir),
      rates_tried=rates_tried(workdir, sweep.mixers),
      max_steps=sweep.get("max_steps"),
      cells=records,
      comparisons=compare(records, sweep.mixers, curves),
      bits_comparisons=compare_bits(records, sweep.mixers),
      runs=[dict(name=r.name, **{k: v for k, v in s.items()})
            for r, s in found])
  os.makedirs(workdir, exist_ok=True)
  metrics_lib.write_atomic(os.path.join(workdir, "results.json"),
                           json.dumps(results, indent=1))
  metrics_lib.write_atomic(os.path.join(workdir, "results.md"),
                           sweep_markdown.results_markdown(results))
  if records:
    sweep_figures.plot_sweep(results, sweep, workdir)
  return results


# A per-seed difference of best accuracy within this is a tie, not an order.
# On the Kimi suite's runs flat at the cap, held-out accuracy scatters about
# its trend with an SD of 0.1-0.5 points and the best evaluation sits 0-0.8
# points above the last: a smaller gap is evaluation noise.
TIE_MARGIN = 0.01


def _verdict(a: Sequence[float], b: Sequence[float]) -> str:
  """The order of two mixers from their per-seed accuracies `a` and `b`."""
  diff = [x - y for x, y in zip(a, b)]
  if min(list(a) + list(b)) >= metrics_lib.TARGET_ACCURACY:
    return "both solve in every seed"
  if min(diff) > TIE_MARGIN:
    return "ahead in every seed"
  if max(diff) < -TIE_MARGIN:
    return "behind in every seed"
  if max(abs(d) for d in diff) <= TIE_MARGIN:
    return f"within {100 * TIE_MARGIN:g} point in every seed"
  return "mixed"


def best_up_to(curve: tuple[Sequence[int], Sequence[float]],
               step: int) -> float:
  """The best held-out accuracy of an eval curve (steps, accuracies) at
  steps <= `step`."""
  steps, accs = curve
  return max(a for s, a in zip(steps, accs) if s <= step)


def _mixer_pairs(cells, mixers, keep=lambda c: True):
  """((task, seq_len, mixer, other), (cell, other cell)) for every pair of
  `mixers` (in that order) trained on the same task and length, among the
  cells `keep` accepts."""
  by_key = {(c["task"], c["seq_len"], c["mixer"]): c for c in cells
            if keep(c)}
  for (task, seq_len, mixer), first in by_key.items():
    if mixer not in mixers:
      continue
    for other in mixers[mixers.index(mixer) + 1:]:
      second = by_key.get((task, seq_len, other))
      if second is not None:
        yield (task, seq_len, mixer, other), (first, second)


def compare(cells: Sequence[dict[str, Any]], mixers: Sequence[str],
            curves: dict[tuple, tuple] | None = None
            ) -> list[dict[str, Any]]:
  """Per (task, length): every pair of mixers (in `mixers`' order), by seed.

  The per-seed difference of best held-out accuracy (the seeds both have),
  its mean, min and max, and a verdict: "ahead in every seed" / "behind in
  every seed" (by more than TIE_MARGIN in each), "within 1 point in every
  seed", "both solve in every seed" (then steps to 99% tell them apart), or
  "mixed". With `curves` ({(task, seq_len, mixer, seed): (eval steps,
  accuracies)}), also `equal_steps`: the same at equal budgets, each
  seed's pair compared at the shorter run's last evaluated step (each
  run's best up to there; `steps`: that step per seed), since a run
  extended while still rising has had more steps than one that stopped.
  """
  out = []
  for (task, seq_len, mixer, other), (first, second) in _mixer_pairs(
      cells, mixers):
    seeds = sorted(set(first["best_by_seed"]) & set(second["best_by_seed"]))
    a = [first["best_by_seed"][s] or 0.0 for s in seeds]
    b = [second["best_by_seed"][s] or 0.0 for s in seeds]
    if not seeds:
      continue
    record = dict(task=task, seq_len=seq_len, mixer=mixer, other=other,
                  seeds=seeds,
                  difference=_stats([x - y for x, y in zip(a, b)]),
                  verdict=_verdict(a, b))
    keys = [((task, seq_len, mixer, s), (task, seq_len, other, s))
            for s in seeds]
    if curves is not None and all(
        curves.get(k) and curves[k][0] for pair in keys for k in pair):
      steps = [min(curves[k][0][-1] for k in pair) for pair in keys]
      a = [best_up_to(curves[k], n) for (k, _), n in zip(keys, steps)]
      b = [best_up_to(curves[k], n) for (_, k), n in zip(keys, steps)]
      record["equal_steps"] = dict(
          steps=dict(zip(seeds, steps)),
          difference=_stats([x - y for x, y in zip(a, b)]),
          verdict=_verdict(a, b))
    out.append(record)
  order = {m: i for i, m in enumerate(mixers)}
  return sorted(out, key=lambda c: (c["task"], c["seq_len"],
                                    order[c["mixer"]], order[c["other"]]))


def compare_bits(cells: Sequence[dict[str, Any]],
                 mixers: Sequence[str]) -> list[dict[str, Any]]:
  """Per (task, length trained, evaluation length): every pair of mixers'
  per-seed difference of held-out bits per byte (a seed's models score
  the same held-out bytes), with its spread across seeds.

  Each record: the pair, `length`, `seeds`, `differences` (per seed, first
  minus second), `steps` (per seed, the two runs' steps), `mean`, `sd`
  (across seeds, ddof 1; None for one seed), `min`, `max`, and a verdict:
  "lower in every seed" / "higher in every seed" / "mixed". The final
  parameters' bits at each length, and, at the training length, a record
  with `equal_steps` True: each seed's pair at the shorter run's last
  evaluated step (the held-out curve), since a run extended while its bits
  still fell has trained longer than one that had converged.
  """
  out = []
  for (task, seq_len, mixer, other), (first, second) in _mixer_pairs(
      cells, mixers, keep=lambda c: c.get("bits_by_seed")):
    a, b = first["bits_by_seed"], second["bits_by_seed"]
    seeds = sorted(set(a) & set(b))
    if not seeds:
      continue
    lengths = sorted({n for s in seeds for n in a[s] if n.isdigit()}
                     & {n for s in seeds for n in b[s] if n.isdigit()},
                     key=int)

    def record(length, diffs, steps, equal_steps):
      diffs = [float(d) for d in diffs]
      verdict = ("lower in every seed" if max(diffs) < 0 else
                 "higher in every seed" if min(diffs) > 0 else "mixed")
      return dict(task=task, seq_len=seq_len, mixer=mixer, other=other,
                  length=int(length), equal_steps=equal_steps, seeds=seeds,
                  differences=diffs, steps=steps,
                  mean=float(np.mean(diffs)),
                  sd=float(np.std(diffs, ddof=1)) if len(diffs) > 1
                  else None, min=min(diffs), max=max(diffs),
                  verdict=verdict)

    for n in lengths:
      if not all(n in a[s] and n in b[s] for s in seeds):
        continue
      out.append(record(n, [a[s][n] - b[s][n] for s in seeds],
                        [[a[s]["steps"], b[s]["steps"]] for s in seeds],
                        False))
    stops = [min(a[s]["curve"][0][-1], b[s]["curve"][0][-1])
             for s in seeds]
    at = lambda curve, step: curve[1][list(curve[0]).index(step)]
    if all(stop in a[s]["curve"][0] and stop in b[s]["curve"][0]
           for s, stop in zip(seeds, stops)):
      out.append(record(
          seq_len, [at(a[s]["curve"], st) - at(b[s]["curve"], st)
                    for s, st in zip(seeds, stops)],
          [[st, st] for st in stops], True))
  order = {m: i for i, m in enumerate(mixers)}
  return sorted(out, key=lambda c: (c["task"], c["seq_len"],
                                    order[c["mixer"]], order[c["other"]],
                                    c["length"], c["equal_steps"]))


def _length_stats(summaries, key: str = "length_accuracy"
                  ) -> dict[str, dict[str, float]] | None:
  """{length: stats over seeds} of the summaries' `key` ({length: value})."""
  by_len: dict[str, list[float]] = {}
  for s in summaries:
    for n, acc in (s.get(key) or {}).items():
      by_len.setdefault(n, []).append(acc)
  if not by_len:
    return None
  return {n: dict(_stats(v), count=len(v))
          for n, v in sorted(by_len.items(), key=lambda kv: int(kv[0]))}
