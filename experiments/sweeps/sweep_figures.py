"""A sweep's figures: accuracy against length, and curves against step.

`plot_sweep(results, sweep, workdir)` draws, from the dict
`sweep_report.aggregate` returns, accuracy_vs_length.png, curves_T<len>.png
and, with evaluation lengths or on a byte corpus, the figures by evaluation
length and of bits per byte (`plotting.plot_bands_by_task`: a mean line and
a min-max band over seeds per mixer).
"""

import os
from typing import Any

import numpy as np

from experiments.sweeps import sweep_lib
from experiments.training import metrics as metrics_lib
from experiments.training import plotting


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


def plot_by_length(results: dict[str, Any], mixers, path: str, *, key: str,
                   percent: bool = True, **labels) -> bool:
  """Cell statistic `key` (per length) vs evaluation length, one panel per
  trained cell, the task's chance line with `percent`; False if no cell has
  `key`. `labels`: `plotting.plot_bands_by_task`'s xlabel, ylabel, title."""
  cells = [c for c in results["cells"] if c.get(key)]
  if not cells:
    return False
  series, chance = {}, {}
  for c in cells:
    panel = f"{c['task']} trained at T={c['seq_len']}"
    stats = c[key]
    series[(panel, c["mixer"])] = ([int(n) for n in stats], *(
        [stats[n][k] for n in stats] for k in ("mean", "min", "max",
                                                "count")))
    if percent:
      chance[panel] = c["chance_accuracy"]
  plotting.plot_bands_by_task(
      series, tasks=list(dict.fromkeys(p for p, _ in series)), mixers=mixers,
      chance=chance, log_x=True, percent=percent, path=path, **labels)
  return True


def plot_sweep(results: dict[str, Any], sweep, workdir: str) -> None:
  """accuracy_vs_length.png, curves_T<len>.png for the curve length and,
  with evaluation lengths, length_generalisation.png (and, on a byte corpus,
  bits_per_byte_vs_length.png and bits_per_byte_curves_T<len>.png)."""
  cells = results["cells"]
  tasks = sorted({c["task"] for c in cells})
  mixers = [m for m in list(sweep.mixers) + [
      sweep.get("ablation", {}).get("mixer")] if m]
  plot_by_length(
      results, mixers, os.path.join(workdir, "length_generalisation.png"),
      key="length_accuracy", xlabel="evaluation length T",
      ylabel="held-out accuracy (%)",
      title="final parameters at longer lengths (mean, band: min-max over"
      " seeds)")
  plot_by_length(
      results, mixers, os.path.join(workdir, "bits_per_byte_vs_length.png"),
      key="bits_per_byte", percent=False,
      xlabel="evaluation length T (bytes)", ylabel="held-out bits per byte",
      title="final parameters at the training length and longer (mean, band:"
      " min-max over seeds)")
  series, rising, per_seed = {}, {}, {}
  for task in tasks:
    for mixer in mixers:
      rows = sorted((c for c in cells
                     if c["task"] == task and c["mixer"] == mixer
                     and c["best_accuracy"] is not None),
                    key=lambda c: c["seq_len"])
      if rows:
        rising[(task, mixer)] = [
            any(st in (c.get("statuses") or {}) for st in metrics_lib.LEARNING)
            for c in rows]
        per_seed[(task, mixer)] = [
            [v for v in (c.get("best_by_seed") or {}).values()
             if v is not None] for c in rows]
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
      " seeds, dots: seeds)",
      path=os.path.join(workdir, "accuracy_vs_length.png"),
      rising=rising, per_seed=per_seed)
  if sweep.get("curve_seq_len"):
    _plot_curves(results, sweep, workdir, tasks, mixers, chance)


def _plot_curves(results, sweep, workdir, tasks, mixers, chance) -> None:
  """curves_T<len>.png (and on a byte corpus bits_per_byte_curves_T<len>.png)
  at the sweep's curve_seq_len: each mixer's held-out curve over seeds."""
  cells, curve_len = results["cells"], sweep.curve_seq_len
  runs_by_key = {}
  for run in results["runs"]:
    task_len, rest = run["name"].split("/")
    runs_by_key.setdefault((task_len, rest.rsplit("_seed", 1)[0],
                            rest.rsplit("_lr", 1)[1]), []).append(run)
  curves, bits = {}, {}
  for c in cells:
    if c["seq_len"] != curve_len:
      continue
    key = (sweep_lib.cell_name(c["task"], c["seq_len"]), c["mixer"],
           f"{c['learning_rate']:g}")
    runs = runs_by_key.get(key, [])
    if not runs:
      continue
    last = max(r["eval_steps"][-1] for r in runs if r["eval_steps"])
    grid = np.unique(np.concatenate(
        [r["eval_steps"] for r in runs] + [[last]]))
    ys = np.stack([_curve_on_grid(r["eval_steps"], r["eval_accuracy"], grid)
                   for r in runs])
    curves[(c["task"], c["mixer"])] = _band(grid, ys)
    if all(r.get("eval_bits") for r in runs):  # a byte corpus
      bits[(c["task"], c["mixer"])] = _band(grid, np.stack(
          [_curve_on_grid(r["eval_steps"], r["eval_bits"], grid)
           for r in runs]))
  if curves:
    plotting.plot_bands_by_task(
        curves, tasks=tasks, mixers=mixers, chance=chance, log_x=False,
        xlabel="training step", ylabel="held-out accuracy (%)",
        title=f"held-out accuracy at T={curve_len} (mean, band: min-max over"
        " seeds)", path=os.path.join(workdir, f"curves_T{curve_len}.png"))
  if bits:
    plotting.plot_bands_by_task(
        bits, tasks=tasks, mixers=mixers, chance={}, log_x=False,
        log_y=True, percent=False, xlabel="training step",
        ylabel="held-out bits per byte",
        title=f"held-out bits per byte at T={curve_len} (mean, band: min-max"
        " over seeds)",
        path=os.path.join(workdir, f"bits_per_byte_curves_T{curve_len}.png"))


def _band(grid, ys) -> tuple[list[float], ...]:
  """(x, mean, min, max, count) over the rows of `ys` (runs) on `grid`."""
  return (list(grid), list(np.nanmean(ys, 0)), list(np.nanmin(ys, 0)),
          list(np.nanmax(ys, 0)), [len(ys)] * len(grid))
