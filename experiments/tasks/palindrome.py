"""Palindrome: reverse a random string after a separator (Kimi Linear §5.1).

Layout of one example, with L = `seq_len` // 2 symbols x_1 .. x_L:

    position  0   1  ...  L-1   L    L+1      ...  2L-1
    inputs    x_1 x_2 ... x_L   |    x_L      ...  x_2
    targets                     x_L  x_{L-1}  ...  x_1
    mask      0   0  ...  0     1    1        ...  1

Symbols are drawn uniformly (with repetition) from `alphabet_size` letters,
token ids 2 .. alphabet_size + 1; 1 is the separator `|` and 0 the filler
(the last position when `seq_len` is odd, unscored). After the separator the
model predicts the string backwards and is fed what it should already have
produced (teacher forcing), so the target at position L + j is x_{L-j}: the
symbol written 2 j + 1 tokens earlier. Every symbol is independent and
uniform, so a model without memory of the first half scores 1 / alphabet_size.

Worked example (`seq_len=8`, `alphabet_size=4`, letters a b c d = ids 2 3 4 5;
x = b d a c):

    inputs   3 5 2 4 1 4 2 5      (b d a c | c a d)
    targets  0 0 0 0 4 2 5 3      (- - - - c a d b)
    mask     0 0 0 0 1 1 1 1

Unlike copying, the distance between a symbol and its query ranges from 1
(the last symbol, read right after the separator) to 2 L - 1 (the first one,
read last), so the task probes recall at every lag up to the full length.
"""

import dataclasses

import numpy as np

from experiments.tasks import base

FILLER = 0
SEPARATOR = 1
FIRST_LETTER = 2


@dataclasses.dataclass(frozen=True)
class Palindrome:
  """`seq_len` // 2 symbols, a separator, then the symbols reversed."""

  seq_len: int = 256  # T; the string has T // 2 symbols
  alphabet_size: int = 16  # A: letters are ids 2 .. A + 1
  name: str = dataclasses.field(default="palindrome", init=False)

  def __post_init__(self):
    base.check_positive_int("task.seq_len", self.seq_len, 2)
    base.check_positive_int("task.alphabet_size", self.alphabet_size, 2)

  @property
  def num_symbols(self) -> int:
    return self.seq_len // 2

  @property
  def vocab_size(self) -> int:
    return self.alphabet_size + FIRST_LETTER

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / self.alphabet_size

  def answer_positions(self, batch: base.Batch) -> np.ndarray:
    """Position L + j answers with x_{L - j}: written at L - j - 1."""
    t = batch.inputs.shape[1]
    half = self.num_symbols
    j = np.arange(t) - half
    src = np.where((j >= 0) & (j < half), half - j - 1, -1)
    out = np.broadcast_to(src, batch.inputs.shape).copy()
    out[np.asarray(batch.mask) <= 0] = -1
    return out

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    base.check_positive_int("batch_size", batch_size)
    n = self.num_symbols
    x = rng.integers(FIRST_LETTER, FIRST_LETTER + self.alphabet_size,
                     size=(batch_size, n)).astype(np.int32)
    reversed_x = x[:, ::-1]
    inputs = np.full((batch_size, self.seq_len), FILLER, np.int32)
    targets = np.zeros((batch_size, self.seq_len), np.int32)
    mask = np.zeros((batch_size, self.seq_len), np.float32)
    inputs[:, :n] = x
    inputs[:, n] = SEPARATOR
    inputs[:, n + 1:2 * n] = reversed_x[:, :-1]
    targets[:, n:2 * n] = reversed_x
    mask[:, n:2 * n] = 1.0
    return base.Batch(inputs=inputs, targets=targets, mask=mask)
