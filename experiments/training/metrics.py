"""The metrics log of a run: metrics.jsonl and TensorBoard scalars.

One JSON object per logged step (`split` "train" or "eval"); on resume the
records logged after the restored checkpoint are dropped, so a killed run
ends with the same metrics as an uninterrupted one.
"""

import json
import os
from typing import Any, Sequence

from absl import logging
import numpy as np
import tensorboardX

from experiments.training import distributed

TARGET_ACCURACY = 0.99  # "solved": steps to this held-out accuracy

# A run's status, from its metrics (`run_status`).
SOLVED, PLATEAUED, RISING = "solved", "plateaued", "rising at cap"
# "plateaued" (`run_status`): over the last PLATEAU_FRACTION of the run's
# steps, held-out accuracy rose by less than PLATEAU_GAIN (0.5 points) by
# two measures: the best evaluation against the best of the PLATEAU_FRACTION
# before, and the least-squares line through the last PLATEAU_FRACTION; so
# too at the end of the part trained at >= half the peak rate, where a
# schedule decays. At the sweeps' eval_every of 25, 1000 steps put 9 and 8
# evaluations in the two windows.
PLATEAU_FRACTION = 0.2
PLATEAU_GAIN = 0.005
# The held-out loss rule (`train.status_rule="loss"`, the language model):
# CONVERGED once the held-out loss, in bits (bits per byte on a byte
# corpus), falls by less than CONVERGE_FALL over the last CONVERGE_FRACTION
# of the steps, after at least CONVERGE_MIN_STEPS; FALLING ("falling at
# cap") until then (`loss_status`).
CONVERGED, FALLING = "converged", "falling at cap"
CONVERGE_FRACTION = 0.1
CONVERGE_FALL = 0.005
CONVERGE_MIN_STEPS = 2000
# Every status, and those of a run still learning at its cap (a sweep
# extends these: experiments/sweeps/sweep_lib.py).
STATUSES = (SOLVED, PLATEAUED, RISING, CONVERGED, FALLING)
LEARNING = (RISING, FALLING)
STATUS_RULES = ("accuracy", "loss")  # train.status_rule
# `pause_seconds`: a logging window slower per step than this many times its
# run's median is a pause (a stopped or starved process), not training.
PAUSE_FACTOR = 10.0


class MetricsLog:
  """metrics.jsonl + TensorBoard; on resume drops records after the step."""

  def __init__(self, workdir: str, resume_step: int, *, writer: bool = True):
    """`writer=False` (processes other than 0) keeps records in memory only.

    Every process reads the existing file before any rewrites it (a barrier
    across processes in a multi-process run).
    """
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writer = writer
    self.records = []
    if os.path.exists(self.path):
      self.records = read_records(self.path)
    distributed.line_up("metrics log read")
    kept = [r for r in self.records if r["step"] <= resume_step]
    if len(kept) != len(self.records):
      logging.info("Dropping %d metric records logged after step %d.",
                   len(self.records) - len(kept), resume_step)
    self.records = kept
    self.tb = None
    if not writer:
      return
    write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
    self.tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, record: dict[str, Any]) -> None:
    self.records.append(record)
    if not self.writer:
      return
    with open(self.path, "a") as f:  # one write of one whole line
      f.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key not in ("step", "split") and value is not None:
        self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

  def evals(self) -> list[dict[str, Any]]:
    return [r for r in self.records if r["split"] == "eval"]

  def close(self):
    if self.tb is not None:
      self.tb.close()


def check_folder(path: str, name: str = "workdir") -> None:
  """Raises ValueError if `path` is a file or would be under one (the
  nearest existing folder above it is a file); outputs go under `path`,
  created when missing."""
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    where = "is" if existing == os.path.abspath(path) else (
        f"would be under {existing}, which is")
    raise ValueError(f"{name} {path} {where} a file, not a folder; give a"
                     " folder (it is created when missing).")


def write_atomic(path: str, text: str) -> None:
  """Writes `path` whole or not at all (temporary file, then os.replace).

  A kill at any instant leaves either the old file or the new one.
  """
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_records(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl; a torn last line is dropped.

  A process killed while appending leaves at most its last line unfinished:
  that line is dropped with a warning (its step is retrained on resume). A
  damaged line anywhere else is not a kill's doing: ValueError.
  """
  with open(path) as f:
    lines = f.read().split("\n")
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if any(rest.strip() for rest in lines[i + 1:]):
        raise ValueError(f"{path} line {i + 1} is not a JSON record (a"
                         " damaged file, not a torn last line): "
                         f"{line[:80]!r}.") from None
      logging.warning("Dropping the torn last line of %s (a run killed while"
                      " writing it): %r.", path, line[:80])
  return records


def steps_to_accuracy(evals, target: float = TARGET_ACCURACY) -> int | None:
  """The first evaluated step whose held-out accuracy is >= target."""
  for r in evals:
    if r["accuracy"] >= target:
      return r["step"]
  return None




def run_status(records: Sequence[dict[str, Any]],
               target: float = TARGET_ACCURACY, *,
               rule: str = "accuracy") -> str:
  """A run's status from its metrics, by `rule` (`train.status_rule`).

  "loss": CONVERGED or FALLING, from the held-out loss (`loss_status`).
  "accuracy": SOLVED, PLATEAUED or RISING ("rising at cap"), below.

  SOLVED: some held-out accuracy >= `target`.

  PLATEAUED: flat at the end, by two measures (`_window_change`). With S
  the last evaluated step, the last window holds the evaluations at steps
  >= 0.8 S (PLATEAU_FRACTION) and the window before it those in
  [0.6 S, 0.8 S); each needs 3 evaluations. The run is flat when the best
  held-out accuracy of the last window is less than PLATEAU_GAIN (0.5
  points) above the best of the window before, and the least-squares line
  through the last window rises less than PLATEAU_GAIN from its first step
  to S. Both must hold, at the run's end and at the end of the part
  trained at >= half the peak learning rate (the same windows, as
  fractions of the last step evaluated by then): a decaying schedule's
  low-rate tail cannot pass for a plateau, nor can a run flat while the
  rate was high that was still rising when it stopped. Under a constant
  rate the two are one.

  RISING ("rising at cap"): anything else, a run too short to tell
  included.
  """
  if rule not in STATUS_RULES:
    raise ValueError(f"train.status_rule must be one of {STATUS_RULES}; got"
                     f" {rule!r}.")
  if rule == "loss":
    return loss_status(records)
  evals = [r for r in records if r["split"] == "eval"]
  if any(r["accuracy"] >= target for r in evals):
    return SOLVED
  rates = [(r["step"], r["learning_rate"]) for r in records
           if r["split"] == "train" and r.get("learning_rate") is not None]
  if not rates or not evals:
    return RISING
  peak = max(lr for _, lr in rates)
  hot_end = max(step for step, lr in rates if lr >= 0.5 * peak)
  for stop in sorted({hot_end, evals[-1]["step"]}):
    upto = [r for r in evals if r["step"] <= stop]
    if not upto:
      return RISING
    change = _window_change(upto, "accuracy", PLATEAU_FRACTION)
    if change is None or max(change) >= PLATEAU_GAIN:
      return RISING
  return PLATEAUED


def _window_change(evals: Sequence[dict[str, Any]], key: str,
                   fraction: float) -> tuple[float, float] | None:
  """How `key` of the held-out records changed over the run's last
  `fraction` of steps, by two measures, or None when there are too few
  evaluations to tell (fewer than 3 in either window below).

  With S the last evaluated step, the last window holds the evaluations at
  steps >= (1 - fraction) S and the window before it those in
  [(1 - 2 fraction) S, (1 - fraction) S). Returns (fitted, best):
  `fitted`, the change of the least-squares line through the last window
  from its first step to S; `best`, the highest value of the last window
  minus the highest of the one before. (Negate `key`'s values to read a
  fall of a loss as a rise.)
  """
  if not evals:
    return None
  last = evals[-1]["step"]
  start, before = (1 - fraction) * last, (1 - 2 * fraction) * last
  window = [r for r in evals if r["step"] >= start]
  previous = [r for r in evals if before <= r["step"] < start]
  if len(window) < 3 or len(previous) < 3:
    return None
  steps = np.array([r["step"] for r in window], float)
  values = np.array([r[key] for r in window], float)
  fitted = np.polyfit(steps, values, 1)[0] * (last - steps[0])
  best = values.max() - max(r[key] for r in previous)
  return float(fitted), float(best)


def loss_status(records: Sequence[dict[str, Any]]) -> str:
  """CONVERGED or FALLING ("falling at cap") from the held-out loss.

  CONVERGED: the run trained at least CONVERGE_MIN_STEPS steps and its
  held-out loss in bits (`loss / ln 2`: bits per byte on a byte corpus)
  fell by less than CONVERGE_FALL over the last CONVERGE_FRACTION of its
  steps by both measures of `_window_change`: the least-squares line
  through the evaluations of that last tenth falls less than CONVERGE_FALL
  from its start to its end, and the lowest loss of the last tenth is less
  than CONVERGE_FALL below the lowest of the tenth before it (each window
  needs 3 evaluations). FALLING: anything else, a run too short to tell
  included.
  """
  evals = [dict(step=r["step"], minus_bits=-r["loss"] / np.log(2))
           for r in records if r["split"] == "eval"]
  if not evals or evals[-1]["step"] < CONVERGE_MIN_STEPS:
    return FALLING
  change = _window_change(evals, "minus_bits", CONVERGE_FRACTION)
  if change is None or max(change) >= CONVERGE_FALL:
    return FALLING
  return CONVERGED


def _train_windows(
    records: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
  """(steps, seconds) of each logged training window, over every resume."""
  windows, previous = [], 0
  for r in records:
    if r["split"] == "train" and r.get("steps_per_second"):
      steps = r["step"] - previous
      windows.append((steps, steps / r["steps_per_second"]))
      previous = r["step"]
  return windows


def pause_seconds(records: Sequence[dict[str, Any]],
                  factor: float = PAUSE_FACTOR) -> float:
  """The part of `train_seconds` spent in pauses, not in training.

  A logging window whose time per step is over `factor` times the run's
  median is a pause (the process stopped, or starved by other jobs): its
  time beyond the median pace counts here. Compilation after a resume, a
  few times the median over one window, does not.
  """
  windows = [(n, t) for n, t in _train_windows(records) if n > 0]
  if not windows:
    return 0.0
  pace = float(np.median([t / n for n, t in windows]))
  return float(sum(t - n * pace for n, t in windows if t > factor * n * pace))


def train_seconds(records: Sequence[dict[str, Any]]) -> float:
  """Wall seconds of the training steps in `records`, over every resume.

  Each train record covers the steps since the one before at its
  `steps_per_second` (evaluation and the first step's compilation
  included), so the sum is the run's whole training time, not only the
  last invocation's.
  """
  return float(sum(t for _, t in _train_windows(records)))
