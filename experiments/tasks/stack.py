"""Stack: many independent stacks under a stream of PUSH and POP (Kimi Linear §5.1).

The input is a stream of operations on S = `num_stacks` stacks, each either

    PUSH id x   (three tokens: push value x onto stack id)
    POP id      (two tokens: pop stack id)

and the target at the `id` token of every POP is the value on top of that
stack just before the POP (the last value pushed onto it and not yet popped),
which the POP removes. Only those positions are scored. Each operation is a
PUSH with probability `push_probability` (onto a uniformly drawn stack, with
a uniformly drawn value) and otherwise a POP of a uniformly drawn non-empty
stack; when every stack is empty it is a PUSH. The stream fills the sequence:
when fewer than three tokens are left only a POP fits, and when no operation
fits the rest is filler.

Token ids: 0 filler, 1 PUSH, 2 POP, stack ids 3 .. S + 2, values
S + 3 .. S + M + 2 with M = `num_values`. Values are independent and uniform,
so a model that has not kept the pushes scores 1 / M on the POPs.

Worked example (`num_stacks=2`, `num_values=3`: stacks A B = ids 3 4,
values p q r = ids 5 6 7; `seq_len=12`):

    inputs   1 3 5  1 4 6  1 3 7  2 3  2 ...   (PUSH A p, PUSH B q, PUSH A r,
                                                POP A, POP ...)
    targets  0 0 0  0 0 0  0 0 0  0 7  0 ...   (POP A returns r, the later push)
    mask     0 0 0  0 0 0  0 0 0  0 1  0 ...

A second `POP A` would then be scored with p. To score well the model must
keep, for every stack, its values in push order, and forget exactly the one
that each POP removes.
"""

import dataclasses

import numpy as np

from experiments.tasks import base

FILLER = 0
PUSH = 1
POP = 2
FIRST_STACK = 3


@dataclasses.dataclass(frozen=True)
class Stack:
  """`num_stacks` stacks, `num_values` values, PUSH / POP until `seq_len`."""

  seq_len: int = 256  # T
  num_stacks: int = 64  # S: stack ids 3 .. S + 2
  num_values: int = 16  # M: values S + 3 .. S + M + 2
  push_probability: float = 0.5  # of a PUSH when some stack is non-empty
  name: str = dataclasses.field(default="stack", init=False)

  def __post_init__(self):
    base.check_positive_int("task.seq_len", self.seq_len, 5)
    base.check_positive_int("task.num_stacks", self.num_stacks)
    base.check_positive_int("task.num_values", self.num_values, 2)
    p = self.push_probability
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
      raise ValueError(
          f"task.push_probability must be in (0, 1); got {p!r}.")

  @property
  def first_value(self) -> int:
    return FIRST_STACK + self.num_stacks

  @property
  def vocab_size(self) -> int:
    return self.first_value + self.num_values

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / self.num_values

  def _sample_row(self, rng: np.random.Generator, inputs, targets, mask):
    stacks = [[] for _ in range(self.num_stacks)]
    nonempty = []  # ids of the non-empty stacks, unordered
    t, end = 0, self.seq_len
    while end - t >= 2:
      can_push = end - t >= 3
      pop = bool(nonempty) and (not can_push
                                or rng.random() >= self.push_probability)
      if pop:
        s = nonempty[rng.integers(len(nonempty))]
        inputs[t:t + 2] = (POP, FIRST_STACK + s)
        targets[t + 1] = self.first_value + stacks[s].pop()
        mask[t + 1] = 1.0
        if not stacks[s]:
          nonempty.remove(s)
        t += 2
      elif can_push:
        s = int(rng.integers(self.num_stacks))
        x = int(rng.integers(self.num_values))
        inputs[t:t + 3] = (PUSH, FIRST_STACK + s, self.first_value + x)
        if not stacks[s]:
          nonempty.append(s)
        stacks[s].append(x)
        t += 3
      else:  # two tokens left and every stack empty
        break

  def answer_positions(self, batch: base.Batch) -> np.ndarray:
    """A POP's answer is the value of the PUSH it pops, replayed per row."""
    inputs, mask = np.asarray(batch.inputs), np.asarray(batch.mask) > 0
    out = np.full(inputs.shape, -1, np.int64)
    for i, row in enumerate(inputs):
      stacks: dict[int, list[int]] = {}
      for op, stack, pos in _operations(row):
        if op == PUSH:
          stacks.setdefault(stack, []).append(pos)
        else:
          out[i, pos] = stacks[stack].pop()
    out[~mask] = -1
    return out

  def baseline_correct(self, batch: base.Batch) -> np.ndarray:
    """[B, T] bool: where recalling the last push onto the popped stack is
    right (False off the scored positions).

    A model that keeps, per stack, only its most recent PUSH and ignores the
    POPs (associative recall by stack id) is right unless that value was
    popped already, and then only when an older value equals it. A Stack
    score shows the stack discipline only above this bar, which at the
    suite's 64 stacks and push probability 0.5 is most of the way to 100%;
    the POPs where it is wrong are the ones that need the stack.
    """
    inputs, targets = np.asarray(batch.inputs), np.asarray(batch.targets)
    mask = np.asarray(batch.mask) > 0
    out = np.zeros(inputs.shape, bool)
    for i, row in enumerate(inputs):
      last: dict[int, int] = {}  # stack id -> value of its latest PUSH
      for op, stack, pos in _operations(row):
        if op == PUSH:
          last[stack] = int(row[pos])
        elif mask[i, pos]:
          out[i, pos] = last[stack] == targets[i, pos]
    return out

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    base.check_positive_int("batch_size", batch_size)
    shape = (batch_size, self.seq_len)
    inputs = np.full(shape, FILLER, np.int32)
    targets = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    for row in range(batch_size):
      self._sample_row(rng, inputs[row], targets[row], mask[row])
    return base.Batch(inputs=inputs, targets=targets, mask=mask)


def _operations(row: np.ndarray):
  """Yields (PUSH, stack id, value position) / (POP, stack id, id position)
  for each operation of a row, in order, as the model reads them."""
  p, t = 0, len(row)
  while p < t:
    if row[p] == PUSH and p + 2 < t:
      yield PUSH, int(row[p + 1]), p + 2
      p += 3
    elif row[p] == POP and p + 1 < t:
      yield POP, int(row[p + 1]), p + 1
      p += 2
    else:
      p += 1
