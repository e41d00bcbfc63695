"""Accuracy-against-step plots (matplotlib, Agg backend: no display needed)."""

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # pylint: disable=g-import-not-at-top,wrong-import-position
import matplotlib.lines  # pylint: disable=g-import-not-at-top,wrong-import-position
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

RISING_LABEL = "a run still rising at its cap"


def plot_accuracy(curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
                  *, chance: float, path: str, title: str) -> None:
  """Writes a PNG of held-out accuracy against step, one line per curve.

  Args:
    curves: label -> (steps, accuracies).
    chance: the task's chance accuracy, drawn as a dashed line.
    path: where to write the PNG.
    title: the plot title.
  """
  fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
  for label, (steps, accs) in curves.items():
    ax.plot(list(steps), [100 * a for a in accs], marker=".", label=label)
  ax.axhline(100 * chance, color="gray", linestyle="--", linewidth=1,
             label=f"chance ({100 * chance:.1f}%)")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out accuracy (%)")
  ax.set_ylim(-2, 102)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def plot_bands_by_task(
    series: Mapping[tuple[str, str], tuple[Sequence[float], ...]], *,
    tasks: Sequence[str], mixers: Sequence[str],
    chance: Mapping[str, float | None], log_x: bool, xlabel: str,
    ylabel: str, title: str, path: str,
    rising: Mapping[tuple[str, str], Sequence[bool]] | None = None,
    per_seed: Mapping[tuple[str, str], Sequence[Sequence[float]]]
    | None = None,
    percent: bool = True, log_y: bool = False) -> None:
  """One panel per task; per mixer a mean line with a min-max band.

  Args:
    series: (task, mixer) -> (x, mean, low, high, count), accuracies as
      fractions; `count` (seeds behind each point) is written beside the
      last point when it is not the same for every point of the sweep.
    tasks: panel order.
    mixers: line order (colours are stable across panels).
    chance: task -> chance accuracy (a dashed line), or None.
    log_x: a log2 x axis (for lengths).
    xlabel, ylabel, title: labels.
    path: where to write the PNG.
    rising: (task, mixer) -> per point, whether a run behind it was still
      rising at its step cap (drawn as a large open marker).
    per_seed: (task, mixer) -> per point, each seed's value (small dots,
      nudged sideways per mixer so that mixers' seeds do not hide each
      other): a band cannot tell two seeds at the top from one.
    percent: the values are fractions drawn as percent on a 0-100 axis;
      False draws them as they are (a loss), on an axis fitted to them.
    log_y: a log y axis (a loss curve from its start, several bits per
      byte, to its tail).
  """
  # At least 7.5 inches wide: one panel still fits the title and legend.
  fig, axes = plt.subplots(1, len(tasks),
                           figsize=(max(4.2 * len(tasks), 7.5), 3.8),
                           dpi=120, squeeze=False)
  colors = {m: f"C{i}" for i, m in enumerate(mixers)}
  counts = {n for s in series.values() for n in s[4]}
  for ax, task in zip(axes[0], tasks):
    for mixer in mixers:
      if (task, mixer) not in series:
        continue
      _draw_mixer(
          ax, series[(task, mixer)], mixer, color=colors[mixer],
          seeds=(per_seed or {}).get((task, mixer)),
          rising=(rising or {}).get((task, mixer), ()),
          nudge=2 ** (0.05 * (mixers.index(mixer) - (len(mixers) - 1) / 2)),
          log_x=log_x, percent=percent, with_count=len(counts) > 1)
    _finish_panel(ax, task, series, chance=chance.get(task), log_x=log_x,
                  percent=percent, log_y=log_y, xlabel=xlabel)
  axes[0][0].set_ylabel(ylabel)
  _legend(fig, axes[0])
  fig.suptitle(title, fontsize=9)
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  fig.savefig(path)
  plt.close(fig)


def _as_drawn(values, percent: bool) -> list[float]:
  """Fractions as percent with `percent`, else the values as they are."""
  return [(100 if percent else 1) * a for a in values]


def _draw_mixer(ax, entry, mixer: str, *, color: str, seeds, rising, nudge,
                log_x: bool, percent: bool, with_count: bool) -> None:
  """One mixer in one panel: its mean line and band, each seed's dots, the
  open markers of points still rising at their cap and the seed count."""
  x, mean, low, high, count = entry
  pct = lambda v: _as_drawn(v, percent)
  ax.plot(x, pct(mean), marker="o", markersize=3, color=color, label=mixer)
  ax.fill_between(x, pct(low), pct(high), color=color, alpha=0.2,
                  linewidth=0)
  if seeds:
    dots = [(xi * nudge if log_x else xi, v)
            for xi, vals in zip(x, seeds) for v in vals]
    ax.plot([d[0] for d in dots], pct([d[1] for d in dots]),
            linestyle="none", marker=".", markersize=4, alpha=0.6,
            color=color)
  open_x = [xi for xi, f in zip(x, rising) if f]
  if open_x:
    ax.plot(open_x, pct([m for m, f in zip(mean, rising) if f]),
            linestyle="none", marker="o", markersize=8,
            markerfacecolor="none", color=color, label=RISING_LABEL)
  if with_count:
    ax.annotate(f"n={count[-1]}", (x[-1], pct(mean)[-1]), fontsize=6,
                color=color, xytext=(3, 0), textcoords="offset points")


def _finish_panel(ax, task: str, series, *, chance: float | None,
                  log_x: bool, percent: bool, log_y: bool,
                  xlabel: str) -> None:
  """A task's panel after its mixers: the chance line, axes and labels."""
  if chance is not None:
    ax.axhline(_as_drawn([chance], percent)[0], color="gray", linestyle="--",
               linewidth=1, label="chance")
  if log_x:
    ax.set_xscale("log", base=2)
    xs = sorted({v for (t, _), s in series.items() if t == task
                 for v in s[0]})
    ax.set_xticks(xs, [str(int(v)) for v in xs])
  if percent:
    ax.set_ylim(-2, 102)
  if log_y:  # ticks as plain numbers (1.5, 2, 3), not powers of ten
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  ax.set_title(task)
  ax.set_xlabel(xlabel)
  ax.grid(alpha=0.3)


def _legend(fig, axes) -> None:
  """One legend below the panels: each label once, in the order drawn."""
  handles = {}
  for ax in axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(label, handle)
  if RISING_LABEL in handles:  # one grey entry for every mixer's markers
    handles[RISING_LABEL] = matplotlib.lines.Line2D(
        [], [], linestyle="none", marker="o", markersize=8,
        markerfacecolor="none", color="gray")
  fig.legend(handles.values(), handles.keys(), loc="lower center",
             ncol=len(handles), fontsize=7, frameon=False)
