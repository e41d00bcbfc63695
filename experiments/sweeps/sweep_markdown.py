"""A sweep's results as results.md: the tables `sweep_report.aggregate` writes.

`results_markdown(results)` renders the dict `aggregate` returns (and
results.json holds): the provenance and compute lines, one row per (task,
length, mixer), then the overview, the per-seed comparisons, the learning
rates tried, the bits-per-byte comparisons, the tables by evaluation length
and one row per run.
"""

from typing import Any

from experiments.training import metrics as metrics_lib


def _pct(stats, key) -> str:
  return "-" if stats is None else f"{100 * stats[key]:.1f}"


def _stages(curriculum) -> str:
  """' (300 at T=256 first)' for a length curriculum; '' for none."""
  if not curriculum:
    return ""
  return " (" + ", ".join(f"{steps} at T={n}" for steps, n in curriculum) + (
      " first)")


def _provenance_lines(runs) -> list[str]:
  """Where the runs came from: the commits, and the devices with their hours."""
  lines = []
  trained_at: dict[str, int] = {}
  for run in runs:
    for commit in run.get("commits") or ["(not recorded)"]:
      trained_at[commit] = trained_at.get(commit, 0) + 1
  if trained_at:
    lines += ["Runs trained at: " + ", ".join(
        f"{c} ({n} run{'s' if n > 1 else ''})"
        for c, n in trained_at.items()) + ".", ""]
  trained_on: dict[str, list] = {}
  for run in runs:
    entry = trained_on.setdefault(run.get("device") or "not recorded",
                                  [0, 0.0])
    entry[0] += 1
    entry[1] += run.get("train_seconds") or 0.0
  if trained_on:
    lines += ["Trained on (the device of each run's last part): " + ", ".join(
        f"{d} ({n} run{'s' if n > 1 else ''}, {sec / 3600:.2f} hours)"
        for d, (n, sec) in trained_on.items()) + ".", ""]
  return lines


def results_markdown(results: dict[str, Any]) -> str:
  """One row per (task, length, mixer): seeds' mean [min, max]."""
  meta = results["metadata"]
  lines = [f"# {results['sweep']}: best held-out accuracy over seeds", ""]
  if meta:
    lines += [", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
  lines += _provenance_lines(results.get("runs", ()))
  lines += [
      f"{results['num_finished']} of {results['num_runs']} runs finished;"
      f" {results['train_seconds'] / 3600:.2f} hours of training, summed"
      " over runs from their metrics (every resumed part included), of which"
      f" {results.get('pause_seconds', 0.0) / 3600:.2f} in pauses (logging"
      f" windows over {metrics_lib.PAUSE_FACTOR:g}x their run's median time"
      " per step: a stopped or starved process).", ""]
  cap = results.get("max_steps")
  below = [r for r in results.get("runs", ())
           if r["status"] in metrics_lib.LEARNING and cap is not None
           and r["num_steps"] < cap]
  if below:
    lines += [
        f"Still learning below the protocol's cap of {cap} steps, to be"
        f" extended (`--extend_to={cap}`): {len(below)} runs: " + ", ".join(
            f"{r['name']} ({r['num_steps']})" for r in below) + ".", ""]
  spent = results.get("workdir_compute")
  if spent and spent["runs"]:
    lines += [
        f"All {spent['runs']} run directories in the workdir (unfinished runs"
        " and other configurations' runs, such as a calibration, included):"
        f" {spent['train_seconds'] / 3600:.2f} hours, of which"
        f" {spent['pause_seconds'] / 3600:.2f} in pauses.", ""]
  rules = {run.get("status_rule", "accuracy")
           for run in results.get("runs", ())} or {"accuracy"}
  lines += [" ".join(STATUS_RULE_TEXT[rule] for rule in STATUS_RULE_TEXT
                     if rule in rules), ""]
  lines += [
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
        f" {_caps(r)}{_stages(r.get('length_curriculum'))} |"
        f" {_statuses(r.get('statuses'))} |"
        f" {'-' if chance is None else f'{100 * chance:.1f}'} |")
  lines += _overview_lines(results["cells"])
  lines += _comparison_lines(results.get("comparisons", ()))
  lines += _rate_lines(results.get("rates_tried", ()), results["cells"])
  lines += _bits_comparison_lines(results.get("bits_comparisons", ()))
  lines += _length_lines(
      results["cells"], "length_accuracy", "Length generalisation: final"
      " parameters' held-out accuracy % at each length",
      lambda st, k: _pct(st, k))
  lines += _length_lines(
      results["cells"], "bits_per_byte", "Held-out bits per byte at each"
      " evaluation length (final parameters)", lambda st, k: f"{st[k]:.3f}",
      with_params=True)
  lines += _run_lines(results.get("runs", ()))
  return "\n".join(lines) + "\n"


# What each status rule is, in results.md (experiments/training/metrics.py).
STATUS_RULE_TEXT = dict(
    accuracy=(
        "Status of a run, from its metrics: solved (>= 99%), plateaued (over"
        f" the last {100 * metrics_lib.PLATEAU_FRACTION:g}% of its steps"
        " the best held-out accuracy rose less than"
        f" {100 * metrics_lib.PLATEAU_GAIN:g} points above the best of the"
        f" {100 * metrics_lib.PLATEAU_FRACTION:g}% before, and so did the"
        " least-squares line through those evaluations; at the run's end and"
        " at the end of its part at >= half the peak rate), rising at cap"
        " (anything else)."),
    loss=(
        "Status of a run, from its held-out loss in bits (bits per byte):"
        f" converged (at least {metrics_lib.CONVERGE_MIN_STEPS} steps, and"
        f" over the last {100 * metrics_lib.CONVERGE_FRACTION:g}% of its"
        " steps both the least-squares line through the evaluations and the"
        " lowest evaluation, against the lowest of the"
        f" {100 * metrics_lib.CONVERGE_FRACTION:g}% before, fall by less than"
        f" {metrics_lib.CONVERGE_FALL:g}), falling at cap (anything else)."),
)


def _length_lines(cells, key: str, heading: str, fmt, *,
                  with_params: bool = False) -> list[str]:
  """A table of the cells' `key` ({length: stats}) at each length, mean
  [min, max] over seeds, each stat written by `fmt(stats, "mean")`; none
  when no cell has `key`."""
  cells = [r for r in cells if r.get(key)]
  if not cells:
    return []
  lengths = sorted({int(n) for r in cells for n in r[key]})
  extra = ["parameters"] if with_params else []
  lines = ["", f"## {heading}, mean [min, max] over seeds", "",
           "| " + " | ".join(["task", "T trained", "mixer"] + extra
                             + ["seeds"] + [f"T={n}" for n in lengths])
           + " |", "|---|---|---|" + "---|" * (len(extra) + 1 + len(lengths))]
  for r in cells:
    stats = r[key]
    cols = [("-" if str(n) not in stats else
             f"{fmt(stats[str(n)], 'mean')} [{fmt(stats[str(n)], 'min')},"
             f" {fmt(stats[str(n)], 'max')}]") for n in lengths]
    first = [r["task"], str(r["seq_len"]), r["mixer"]] + (
        [str(r["num_params"] or "-")] if with_params else [])
    lines.append("| " + " | ".join(first + [str(len(r["seeds"]))] + cols)
                 + " |")
  return lines


def _statuses(statuses) -> str:
  """'2 solved, 1 rising at cap' (or '-' for runs that predate it)."""
  return ", ".join(f"{n} {st}" for st, n in (statuses or {}).items()) or "-"


def _overview_lines(cells) -> list[str]:
  """One row per (task, length), one column per mixer: the README's table."""
  mixers = list(dict.fromkeys(c["mixer"] for c in cells))
  rows: dict[tuple[str, int], dict[str, Any]] = {}
  for c in cells:
    if c["best_accuracy"] is not None:
      rows.setdefault((c["task"], c["seq_len"]), {})[c["mixer"]] = c
  if len(mixers) < 2 or not rows:
    return []
  baselines = any(c.get("baseline_accuracy") for c in cells)
  learning = sorted({st.split()[0] for c in cells
                     for st in c.get("statuses") or {}
                     if st in metrics_lib.LEARNING}, reverse=True) or [
                         "rising"]  # "rising at cap" / "falling at cap"
  lines = ["", "## Overview: best held-out accuracy %, mean [min, max] over"
           " seeds", "",
           "(n) seeds; steps to 99% (mean) where every seed reached it; †"
           f" where a run of the cell was still {' or '.join(learning)} at"
           " its cap."
           + (" Baseline: a task's memory-light rule on the same held-out"
              " sets (Stack: the last value pushed onto the popped stack,"
              " POPs ignored), mean over the seeds' sets." if baselines
              else ""), "",
           "| task | T | chance % | " + ("baseline % | " if baselines else "")
           + " | ".join(mixers) + " |",
           "|---|---|---|" + "---|" * (len(mixers) + baselines)]
  for (task, seq_len), by_mixer in sorted(rows.items()):
    cols = []
    for m in mixers:
      c = by_mixer.get(m)
      if c is None:
        cols.append("-")
        continue
      acc = c["best_accuracy"]
      col = (f"{_pct(acc, 'mean')} [{_pct(acc, 'min')}, {_pct(acc, 'max')}]"
             f" ({len(c['seeds'])})")
      if c["steps_to_99"] is not None and (
          c["num_reached_99"] == len(c["seeds"])):
        col += f", 99% at {c['steps_to_99']['mean']:.0f}"
      if any((c.get("statuses") or {}).get(st)
             for st in metrics_lib.LEARNING):
        col += " †"
      cols.append(col)
    chance = next(iter(by_mixer.values()))["chance_accuracy"]
    if baselines:
      base = next((c["baseline_accuracy"] for c in by_mixer.values()
                   if c.get("baseline_accuracy")), None)
      cols.insert(0, "-" if base is None else _pct(base, "mean"))
    lines.append(f"| {task} | {seq_len} |"
                 f" {'-' if chance is None else f'{100 * chance:.1f}'} | "
                 + " | ".join(cols) + " |")
  return lines


def _comparison_lines(comparisons) -> list[str]:
  if not comparisons:
    return []
  lines = ["", "## Per-seed differences of best held-out accuracy", "",
           "Each pair at equal steps (each seed's two runs compared at the"
           " shorter run's last evaluated step, the best evaluation up to"
           " it), beside the runs as trained (some extended further while"
           " still rising). An order is claimed only where it holds at equal"
           " steps in every seed.", "",
           "| task | T | pair | seeds | equal steps, per seed |"
           " difference at equal steps, points: mean [min, max] |"
           " verdict at equal steps | difference as trained |"
           " verdict as trained |", "|---|---|---|---|---|---|---|---|---|"]
  for c in comparisons:
    d, eq = c["difference"], c.get("equal_steps")
    if eq is None:
      eq_cols = ["-", "-", "-"]
    else:
      e = eq["difference"]
      eq_cols = [" / ".join(str(eq["steps"][s]) for s in c["seeds"]),
                 _points(e), eq["verdict"]]
    lines.append(
        f"| {c['task']} | {c['seq_len']} | {c['mixer']} - {c['other']} |"
        f" {len(c['seeds'])} | " + " | ".join(eq_cols) +
        f" | {_points(d)} | {c['verdict']} |")
  return lines


def _points(d) -> str:
  """A difference's mean [min, max] in signed points."""
  return (f"{100 * d['mean']:+.1f} [{100 * d['min']:+.1f},"
          f" {100 * d['max']:+.1f}]")


def _bits_comparison_lines(comparisons) -> list[str]:
  if not comparisons:
    return []
  lines = ["", "## Per-seed differences of held-out bits per byte", "",
           "First mixer minus second, per seed (a seed's models score the"
           " same held-out bytes), at each evaluation length with the final"
           " parameters, and at the training length also at equal steps"
           " (each seed's pair at the shorter run's last evaluation). SD:"
           " the spread of the per-seed differences across seeds.", "",
           "| T trained | pair | length | steps per seed | difference per"
           " seed | mean | SD | verdict |", "|---|---|---|---|---|---|---|---|"]
  for c in comparisons:
    steps = " / ".join(f"{x}" if x == y else f"{x}, {y}"
                       for x, y in c["steps"])
    sd = "-" if c["sd"] is None else f"{c['sd']:.3f}"
    lines.append(
        f"| {c['seq_len']} | {c['mixer']} - {c['other']} |"
        f" {c['length']}{' (equal steps)' if c['equal_steps'] else ''} |"
        f" {steps} | " + " / ".join(f"{d:+.3f}" for d in c["differences"])
        + f" | {c['mean']:+.3f} | {sd} | {c['verdict']} |")
  return lines


def _rate_lines(tried, cells) -> list[str]:
  """Per task and mixer, the rates its runs tried at each length, and the
  rate the cells report; none when no cell tried more than one rate."""
  if not any(len(g["rates"]) > 1 for r in tried
             for groups in r["lengths"].values() for g in groups):
    return []
  lengths = sorted({n for r in tried for n in r["lengths"]})
  used = {(c["task"], c["mixer"]): c["learning_rate"] for c in cells}
  lines = ["", "## Learning rates tried (every run directory in the"
           " workdir)", "",
           "Per length, the rates each seed trained at; where one seed tried"
           " several, its best held-out accuracy % at each, up to the"
           " shortest of those runs. A length or seed with one rate had no"
           " rate tuned there.", "",
           "| task | mixer | rate reported | " + " | ".join(
               f"T={n}" for n in lengths) + " |",
           "|---|---|---|" + "---|" * len(lengths)]

  def seeds(ss):
    return "seed" + ("s " if len(ss) > 1 else " ") + ", ".join(map(str, ss))

  for r in tried:
    cols = []
    for n in lengths:
      parts = []
      for g in r["lengths"].get(n, ()):
        if g["steps"] is None:
          parts.append(f"{g['rates'][0]:g} only ({seeds(g['seeds'])})")
        else:
          parts.append(
              f"{seeds(g['seeds'])} at {g['steps']} steps: " + ", ".join(
                  f"{lr:g} {100 * b:.1f}" for lr, b in zip(g["rates"],
                                                          g["best"])))
      cols.append("; ".join(parts) or "-")
    rate = used.get((r["task"], r["mixer"]))
    lines.append(f"| {r['task']} | {r['mixer']} |"
                 f" {'-' if rate is None else f'{rate:g}'} | "
                 + " | ".join(cols) + " |")
  return lines


def _caps(cell) -> str:
  """A cell's step cap: '1000', or '1000-3000' where its seeds' differ (runs
  extended while still rising)."""
  low, high = cell["min_num_steps"], cell["num_steps"]
  return str(high) if low == high else f"{low}-{high}"


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
