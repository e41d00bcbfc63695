"""Multi-query associative recall (MQAR), the Zoology layout.

Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
Language Models" (arXiv 2312.04927), data generator `multiquery_ar`. With
vocabulary size V and N = `num_pairs`:

* keys are drawn without replacement from [1, V/2), values without
  replacement from [V/2, V), independently per example;
* the context is `k_1 v_1 k_2 v_2 ... k_N v_N` (the first 2N tokens);
* the rest of the sequence (T - 2N tokens) is filler (token 0, or random
  tokens with `random_filler`), except that every key is queried exactly
  once: the queries sit at even offsets 2 g_i after the context, with the
  slots g_i drawn without replacement from p(g) ∝ a g^(a-1) (g = 1 .. S,
  S = (T - 2N) / 2, a = `power_a` = 0.01), so most queries come soon after
  the context and a few far away;
* the target at a query position is the value paired with that key; every
  other position is unscored.

Accuracy is per query token; a model that cannot see the context can do no
better than guess a value: chance = 1 / (V - V // 2).
"""

import dataclasses

import numpy as np

from experiments.tasks import base

FILLER = 0


@dataclasses.dataclass(frozen=True)
class MQAR:
  """N key-value pairs, then each key queried once at power-law gaps."""

  seq_len: int = 256  # T, even
  num_pairs: int = 16  # N
  vocab_size: int = 256  # V: keys in [1, V/2), values in [V/2, V)
  power_a: float = 0.01  # power-law exponent a of the query gaps
  random_filler: bool = False  # filler tokens drawn from [0, V) instead of 0
  name: str = dataclasses.field(default="mqar", init=False)

  def __post_init__(self):
    base.check_positive_int("task.seq_len", self.seq_len, 2)
    base.check_positive_int("task.num_pairs", self.num_pairs)
    base.check_positive_int("task.vocab_size", self.vocab_size, 4)
    if self.seq_len % 2:
      raise ValueError(f"task.seq_len must be even; got {self.seq_len}.")
    if 4 * self.num_pairs > self.seq_len:
      raise ValueError(
          f"task.seq_len ({self.seq_len}) must be >= 4 * task.num_pairs"
          f" ({4 * self.num_pairs}) so every key fits a query slot.")
    if self.vocab_size // 2 - 1 < self.num_pairs:
      raise ValueError(
          f"task.vocab_size ({self.vocab_size}) leaves only"
          f" {self.vocab_size // 2 - 1} keys for task.num_pairs"
          f" ({self.num_pairs}); use vocab_size >= {2 * self.num_pairs + 2}.")
    if not 0 < self.power_a <= 1:
      raise ValueError(f"task.power_a must be in (0, 1]; got {self.power_a!r}.")
    if not isinstance(self.random_filler, bool):
      raise ValueError(
          f"task.random_filler must be a bool; got {self.random_filler!r}.")

  @property
  def num_values(self) -> int:
    return self.vocab_size - self.vocab_size // 2

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / self.num_values

  @property
  def gap_probabilities(self) -> np.ndarray:
    """p(g) for query slots g = 1..S (slot g sits at offset 2 (g - 1))."""
    slots = (self.seq_len - 2 * self.num_pairs) // 2
    g = np.arange(1, slots + 1, dtype=np.float64)
    p = self.power_a * g ** (self.power_a - 1)
    return p / p.sum()

  def answer_positions(self, batch: base.Batch) -> np.ndarray:
    """A query's answer is the value after the key's first context slot."""
    inputs, mask = np.asarray(batch.inputs), np.asarray(batch.mask) > 0
    out = np.full(inputs.shape, -1, np.int64)
    for i in range(inputs.shape[0]):
      first = {}
      for p in range(0, 2 * self.num_pairs, 2):  # keys at even positions
        first.setdefault(int(inputs[i, p]), p)
      for q in np.flatnonzero(mask[i]):
        out[i, q] = first[int(inputs[i, q])] + 1
    return out

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    base.check_positive_int("batch_size", batch_size)
    t, n, half = self.seq_len, self.num_pairs, self.vocab_size // 2
    context = 2 * n
    # Without replacement per row: the first n of a random permutation.
    keys = 1 + np.argsort(rng.random((batch_size, half - 1)), axis=1)[:, :n]
    values = half + np.argsort(
        rng.random((batch_size, self.num_values)), axis=1)[:, :n]
    p = self.gap_probabilities
    slots = np.stack([
        rng.choice(p.size, size=n, replace=False, p=p)
        for _ in range(batch_size)
    ])
    if self.random_filler:
      inputs = rng.integers(0, self.vocab_size, size=(batch_size, t))
    else:
      inputs = np.full((batch_size, t), FILLER)
    inputs = inputs.astype(np.int32)
    targets = np.zeros((batch_size, t), np.int32)
    mask = np.zeros((batch_size, t), np.float32)
    rows = np.arange(batch_size)[:, None]
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    query_pos = context + 2 * slots
    inputs[rows, query_pos] = keys
    targets[rows, query_pos] = values
    mask[rows, query_pos] = 1.0
    return base.Batch(inputs=inputs, targets=targets, mask=mask)
