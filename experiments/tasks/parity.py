"""Parity: the running parity of a bit stream (state tracking).

Grazzi et al. (arXiv 2411.12537) show that a linear recurrence whose
transition matrices have only eigenvalues in [0, 1] (the delta rule with beta
in [0, 1], Mamba's and GLA's decays) cannot track the parity of a bit stream
at arbitrary length, and that allowing eigenvalues in [-1, 1] (the delta
rule with beta in [0, 2], `allow_neg_eigval`) can: a reflection I - 2 k k^T
flips the sign of the state along k, one flip per 1 bit. The task is their
parity with the answer at every position, so a model is scored on every
prefix length up to T.

Layout of one example, bits b_0 .. b_{T-1} drawn uniformly:

    position  0        1              ...  T-1
    inputs    b_0      b_1            ...  b_{T-1}
    targets   p_0      p_1            ...  p_{T-1}     p_t = b_0 xor ... xor b_t
    mask      1        1              ...  1

Token ids: 0 filler (unused: every position holds a bit), 1 the bit 0 and 2
the bit 1; targets use the same ids (1 even, 2 odd). A model without memory
of earlier bits cannot do better than 1/2 after the first position (the
parity of the earlier bits is uniform and independent of b_t); chance is
reported as 1/2.

Worked example (`seq_len=6`; bits 1 0 1 1 0 0):

    inputs   2 1 2 2 1 1
    targets  2 2 1 2 2 2      (parities 1 1 0 1 1 1)
    mask     1 1 1 1 1 1

Length generalisation (train at one T, evaluate the final parameters at
longer ones: `train.eval_lengths`) is where the eigenvalue range shows: a
model that learnt a flip per 1 bit keeps it at any length; one that
approximates parity with decaying memory cannot (configs/sweeps/parity.py).
"""

import dataclasses

import numpy as np

from experiments.tasks import base

FILLER = 0
ZERO = 1  # the bit 0, and the target "even"
ONE = 2  # the bit 1, and the target "odd"


@dataclasses.dataclass(frozen=True)
class Parity:
  """`seq_len` random bits; the target at t is the parity of bits 0..t."""

  seq_len: int = 64  # T, the number of bits
  name: str = dataclasses.field(default="parity", init=False)

  def __post_init__(self):
    base.check_positive_int("task.seq_len", self.seq_len, 1)

  @property
  def vocab_size(self) -> int:
    return 3

  @property
  def chance_accuracy(self) -> float:
    return 0.5

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    base.check_positive_int("batch_size", batch_size)
    bits = rng.integers(0, 2, size=(batch_size, self.seq_len))
    parity = np.bitwise_xor.accumulate(bits, axis=1)
    return base.Batch(
        inputs=(ZERO + bits).astype(np.int32),
        targets=(ZERO + parity).astype(np.int32),
        mask=np.ones((batch_size, self.seq_len), np.float32))
