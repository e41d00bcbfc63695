"""Delayed copy (the copying-memory task, Arjovsky et al. 2016, §4.1).

Layout of one example, with n = `num_symbols` and d its delay:

    inputs   s_1 ... s_n   _ ... _ (d blanks)   :   s_1 ... s_{n-1}   _ ... _
    targets                                     s_1  s_2  ...  s_n
    mask                                        1    1    ...  1         0 ...

Symbols are drawn uniformly (with repetition) from `alphabet_size` letters,
token ids 1..alphabet_size; 0 is the blank and alphabet_size + 1 the
delimiter `:`. After the delimiter the model predicts the symbols in order;
it is fed the symbols it should already have produced (teacher forcing, the
usual language-model form of copying; `teacher_forcing=False` feeds blanks
instead, Arjovsky's original form, where the model must also count). Only the
n output positions are scored. Because every s_i is independent and uniform,
no model without memory of the first n tokens beats 1 / alphabet_size.

With `random_delay=True` each example draws its delay uniformly from
[min_delay, delay]; shorter examples are padded with unscored blanks at the
end, so T = 2 n + delay for every example.
"""

import dataclasses

import numpy as np

from experiments.tasks import base

BLANK = 0


@dataclasses.dataclass(frozen=True)
class DelayedCopy:
  """Copy `num_symbols` symbols after `delay` blanks and a delimiter."""

  num_symbols: int = 10  # n, symbols to remember
  alphabet_size: int = 8  # symbols are ids 1..alphabet_size
  delay: int = 64  # blanks between the symbols and the delimiter (maximum)
  random_delay: bool = False  # draw each example's delay from [min_delay, delay]
  min_delay: int = 0  # smallest delay when random_delay
  teacher_forcing: bool = True  # feed s_1..s_{n-1} after the delimiter
  name: str = dataclasses.field(default="delayed_copy", init=False)

  def __post_init__(self):
    base.check_positive_int("task.num_symbols", self.num_symbols)
    base.check_positive_int("task.alphabet_size", self.alphabet_size, 2)
    base.check_positive_int("task.delay", self.delay, 0)
    base.check_positive_int("task.min_delay", self.min_delay, 0)
    if self.random_delay and self.min_delay > self.delay:
      raise ValueError(
          f"task.min_delay ({self.min_delay}) must be <= task.delay"
          f" ({self.delay}).")
    for field in ("random_delay", "teacher_forcing"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"task.{field} must be a bool; got"
                         f" {getattr(self, field)!r}.")

  @property
  def delimiter(self) -> int:
    return self.alphabet_size + 1

  @property
  def vocab_size(self) -> int:
    return self.alphabet_size + 2

  @property
  def seq_len(self) -> int:
    return 2 * self.num_symbols + self.delay

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / self.alphabet_size

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    base.check_positive_int("batch_size", batch_size)
    n, t = self.num_symbols, self.seq_len
    symbols = rng.integers(1, self.alphabet_size + 1, size=(batch_size, n))
    if self.random_delay:
      delays = rng.integers(self.min_delay, self.delay + 1, size=batch_size)
    else:
      delays = np.full(batch_size, self.delay)
    inputs = np.full((batch_size, t), BLANK, np.int32)
    targets = np.zeros((batch_size, t), np.int32)
    mask = np.zeros((batch_size, t), np.float32)
    rows = np.arange(batch_size)[:, None]
    inputs[:, :n] = symbols
    start = n + delays  # position of the delimiter
    inputs[rows[:, 0], start] = self.delimiter
    out = start[:, None] + np.arange(n)[None, :]  # output positions
    targets[rows, out] = symbols
    mask[rows, out] = 1.0
    if self.teacher_forcing and n > 1:
      inputs[rows, out[:, 1:]] = symbols[:, :-1]
    return base.Batch(inputs=inputs, targets=targets, mask=mask)
