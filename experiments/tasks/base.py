"""What every synthetic task provides: a batch layout and a chance accuracy.

A batch is three [B, T] NumPy arrays: `inputs` (int32 tokens), `targets`
(int32, the token the model should predict at that position) and `mask`
(float32, 1 where the position is scored, 0 elsewhere). Loss and accuracy are
means over the scored positions only.

Data is a pure function of (seed, stream, index): `rng(seed, stream, index)`
seeds NumPy's generator from all three, so the training batch of step `s` is
the same whether a run was interrupted or not, and the held-out stream never
shares a generator state with the training stream.
"""

import dataclasses
from typing import Protocol

import numpy as np

# Generator streams: training batches are indexed by step, held-out batches by
# their position in the fixed evaluation set.
TRAIN_STREAM = 0
EVAL_STREAM = 1


@dataclasses.dataclass(frozen=True)
class Batch:
  """One batch of examples; every array is [B, T]."""

  inputs: np.ndarray  # int32 tokens fed to the model
  targets: np.ndarray  # int32 token to predict at each position (0 if unscored)
  mask: np.ndarray  # float32, 1.0 on the scored positions
  # int32 packed documents 1, 2, .. along a row (0 = padding), or None
  segment_ids: np.ndarray | None = None

  def as_dict(self) -> dict[str, np.ndarray]:
    out = dict(inputs=self.inputs, targets=self.targets, mask=self.mask)
    if self.segment_ids is not None:
      out["segment_ids"] = self.segment_ids
    return out


class Task(Protocol):
  """A synthetic sequence task."""

  name: str

  @property
  def vocab_size(self) -> int:
    """Number of token ids used by inputs and targets."""

  @property
  def seq_len(self) -> int:
    """T, the length of every example."""

  @property
  def chance_accuracy(self) -> float:
    """Accuracy of the best predictor that has no memory of the context."""

  def sample(self, rng: np.random.Generator, batch_size: int) -> Batch:
    """Draws `batch_size` independent examples."""


def baseline_accuracy(task, batches) -> float | None:
  """Accuracy of the task's memory-light rule (`task.baseline_correct`, a
  [B, T] bool of where it is right) over `batches`' scored positions, or
  None for a task without one."""
  if not callable(getattr(task, "baseline_correct", None)):
    return None
  right = sum(int(task.baseline_correct(b).sum()) for b in batches)
  return right / max(sum(int((np.asarray(b.mask) > 0).sum())
                         for b in batches), 1)


def held_out(task):
  """The task held-out batches come from: `task.held_out()` where a task
  has its own held-out data (text: other files), else the task itself (a
  synthetic task's held-out set is its own stream, `EVAL_STREAM`)."""
  return task.held_out() if callable(getattr(task, "held_out", None)) else task


class RecallTask(Task, Protocol):
  """A task whose every scored answer was written at one earlier position."""

  def answer_positions(self, batch: Batch) -> np.ndarray:
    """[B, T] int: where each scored position's answer was written, else -1.

    Read from `batch.inputs` and the task's layout, never from the targets
    (`experiments/sweeps/recall.py` bins accuracy by the distance).
    """


def rng(seed: int, stream: int, index: int) -> np.random.Generator:
  """The generator for batch `index` of `stream` under `seed`."""
  for name, value in (("seed", seed), ("stream", stream), ("index", index)):
    if not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"{name} must be an int >= 0; got {value!r}.")
  return np.random.default_rng([int(seed), int(stream), int(index)])


def check_positive_int(name: str, value, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < minimum):
    raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")
  return int(value)
