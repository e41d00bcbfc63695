"""Recall against lag: where each answer was written, from the inputs alone
(each recall task's `answer_positions`).

The binned accuracy of real runs is checked in test_sweep.py (its smoke
sweep's `--recall` must add up to each run's held-out accuracy).

Every comparison here is exact: positions and lags are integer NumPy code.
"""

import ml_collections
import numpy as np
import pytest

from experiments import tasks
from experiments.sweeps import recall
from experiments.tasks import stack as stack_lib


def _batch(task, seed=0, batch_size=16):
  return task.sample(tasks.rng(seed, tasks.EVAL_STREAM, 0), batch_size)


def _scored(b, src):
  rows, cols = np.nonzero(b.mask > 0)
  assert np.all(src[b.mask == 0] == -1)
  assert np.all(src[rows, cols] >= 0) and np.all(src[rows, cols] < cols)
  # The answer is the token written there: the target, read off the inputs.
  np.testing.assert_array_equal(b.inputs[rows, src[rows, cols]],
                                b.targets[rows, cols])
  return rows, cols


@pytest.mark.parametrize("seq_len", [9, 64])
def test_palindrome_lags_are_odd_and_cover_the_string(seq_len):
  task = tasks.Palindrome(seq_len=seq_len, alphabet_size=4)
  b = _batch(task)
  src = task.answer_positions(b)
  rows, cols = _scored(b, src)
  half = seq_len // 2
  lag = cols - src[rows, cols]
  np.testing.assert_array_equal(lag, 2 * (cols - half) + 1)
  assert sorted(set(lag)) == list(range(1, 2 * half, 2))


def test_mqar_answer_is_the_value_after_the_queried_key():
  task = tasks.MQAR(seq_len=128, num_pairs=8, vocab_size=64)
  b = _batch(task)
  src = task.answer_positions(b)
  rows, cols = _scored(b, src)
  key_pos = src[rows, cols] - 1
  assert np.all(key_pos % 2 == 0) and np.all(key_pos < 2 * task.num_pairs)
  np.testing.assert_array_equal(b.inputs[rows, key_pos], b.inputs[rows, cols])


def test_stack_answer_is_the_latest_unpopped_push_of_that_stack():
  task = tasks.Stack(seq_len=256, num_stacks=4, num_values=8,
                     push_probability=0.5)
  b = _batch(task)
  src = task.answer_positions(b)
  rows, cols = _scored(b, src)
  for i in range(b.inputs.shape[0]):
    x = b.inputs[i]
    popped_at = {int(src[i, q]): int(q) for q in np.flatnonzero(b.mask[i])}
    assert len(popped_at) == int(b.mask[i].sum())  # each push popped once
    for p, q in popped_at.items():
      assert x[p - 2] == stack_lib.PUSH and x[p - 1] == x[q]  # same stack
      # Last in, first out: a later push onto that stack, still before this
      # POP, was popped before it.
      for later in range(p + 1, q):
        if x[later - 2] == stack_lib.PUSH and x[later - 1] == x[q] and (
            later - 2 > p):
          assert popped_at.get(later, q + 1) < q, (i, p, later, q)


def test_a_task_without_answer_positions_names_the_field():
  config = ml_collections.ConfigDict(dict(
      task=dict(name="parity", seq_len=8), train=dict(eval_batches=1)))
  with pytest.raises(ValueError, match="task.name must be one of"):
    recall.held_out_counts(config)
