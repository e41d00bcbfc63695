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

  def as_dict(self) -> dict[str, np.ndarray]:
    return dict(inputs=self.inputs, targets=self.targets, mask=self.mask)


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
