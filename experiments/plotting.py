"""Accuracy-against-step plots (matplotlib, Agg backend: no display needed)."""

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position


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
