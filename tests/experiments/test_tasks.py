"""Invariants of the synthetic task generators (NumPy only, fast).

Every comparison here is exact: the generators are integer NumPy code (masks
are literal 0.0 / 1.0), and a generator drawn twice from one seed repeats the
same computation.
"""

import numpy as np
import pytest

from experiments import tasks


def _mqar_batch(seed=0, **kw):
  task = tasks.MQAR(**kw)
  return task, task.sample(tasks.rng(seed, tasks.TRAIN_STREAM, 0), 32)


@pytest.mark.parametrize("random_filler", [False, True])
def test_mqar_every_query_label_is_the_value_paired_with_its_key(
    random_filler):
  task, b = _mqar_batch(seq_len=128, num_pairs=8, vocab_size=64,
                        random_filler=random_filler)
  n, half = task.num_pairs, task.vocab_size // 2
  assert b.inputs.shape == b.targets.shape == b.mask.shape == (32, 128)
  for row in range(32):
    x, y, m = b.inputs[row], b.targets[row], b.mask[row]
    keys, values = x[0:2 * n:2], x[1:2 * n:2]
    assert np.all((keys >= 1) & (keys < half)), keys
    assert np.all((values >= half) & (values < task.vocab_size)), values
    assert len(set(keys)) == n and len(set(values)) == n
    pairs = dict(zip(keys, values))
    query_pos = np.flatnonzero(m)
    assert len(query_pos) == n  # every key queried exactly once
    assert np.all(query_pos >= 2 * n) and np.all((query_pos - 2 * n) % 2 == 0)
    assert sorted(x[query_pos]) == sorted(keys)
    for p in query_pos:
      assert y[p] == pairs[x[p]]
    assert np.all(y[m == 0] == 0) and set(np.unique(m)) <= {0.0, 1.0}
    if not random_filler:
      filler = np.ones(128, bool)
      filler[:2 * n] = False
      filler[query_pos] = False
      assert np.all(x[filler] == 0)


def test_mqar_gaps_follow_the_power_law():
  task, b = _mqar_batch(seq_len=256, num_pairs=16, vocab_size=256)
  p = task.gap_probabilities
  assert p.size == (256 - 32) // 2 and np.isclose(p.sum(), 1.0)
  assert np.all(np.diff(p) < 0)  # nearer slots are more likely
  slots = (np.flatnonzero(b.mask.ravel()) % 256 - 32) // 2
  # Uniform sampling without replacement would give a mean slot of ~55.5.
  assert slots.mean() < 50, slots.mean()


def test_mqar_chance_and_validation():
  assert tasks.MQAR(vocab_size=256).chance_accuracy == pytest.approx(1 / 128)
  assert tasks.MQAR(vocab_size=33, num_pairs=4,
                    seq_len=64).chance_accuracy == pytest.approx(1 / 17)
  with pytest.raises(ValueError, match="task.seq_len"):
    tasks.MQAR(seq_len=60, num_pairs=16)
  with pytest.raises(ValueError, match="task.vocab_size"):
    tasks.MQAR(seq_len=256, num_pairs=16, vocab_size=32)
  with pytest.raises(ValueError, match="task.seq_len must be even"):
    tasks.MQAR(seq_len=255)
  with pytest.raises(ValueError, match="num_pairz"):
    tasks.make_task("mqar", num_pairz=3)
  with pytest.raises(ValueError, match="task.name"):
    tasks.make_task("mqr")


@pytest.mark.parametrize("teacher_forcing", [True, False])
def test_delayed_copy_layout(teacher_forcing):
  task = tasks.DelayedCopy(num_symbols=10, alphabet_size=8, delay=64,
                           teacher_forcing=teacher_forcing)
  b = task.sample(tasks.rng(1, tasks.TRAIN_STREAM, 5), 16)
  assert task.seq_len == 84 and b.inputs.shape == (16, 84)
  assert task.chance_accuracy == pytest.approx(1 / 8)
  symbols = b.inputs[:, :10]
  assert np.all((symbols >= 1) & (symbols <= 8))
  assert np.all(b.inputs[:, 10:74] == 0)  # the delay is blank
  assert np.all(b.inputs[:, 74] == task.delimiter)
  np.testing.assert_array_equal(b.targets[:, 74:], symbols)
  np.testing.assert_array_equal(b.mask[:, 74:], 1.0)
  assert b.mask[:, :74].sum() == 0 and np.all(b.targets[:, :74] == 0)
  fed = symbols[:, :-1] if teacher_forcing else 0 * symbols[:, :-1]
  np.testing.assert_array_equal(b.inputs[:, 75:], fed)


def test_delayed_copy_random_delay():
  task = tasks.DelayedCopy(num_symbols=4, alphabet_size=5, delay=20,
                           random_delay=True, min_delay=3)
  b = task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 64)
  assert b.inputs.shape == (64, 2 * 4 + 20)
  delims = [np.flatnonzero(row == task.delimiter) for row in b.inputs]
  assert all(len(d) == 1 for d in delims)
  delays = np.array([d[0] - 4 for d in delims])
  assert delays.min() >= 3 and delays.max() <= 20 and len(set(delays)) > 3
  for row, d in enumerate(delays):
    out = slice(4 + d, 8 + d)
    np.testing.assert_array_equal(b.targets[row, out], b.inputs[row, :4])
    assert b.mask[row].sum() == 4 and np.all(b.mask[row, out] == 1)
  with pytest.raises(ValueError, match="task.min_delay"):
    tasks.DelayedCopy(delay=3, random_delay=True, min_delay=5)
  with pytest.raises(ValueError, match="task.alphabet_size"):
    tasks.DelayedCopy(alphabet_size=1)


@pytest.mark.parametrize("task", [
    tasks.MQAR(seq_len=64, num_pairs=4, vocab_size=32),
    tasks.DelayedCopy(num_symbols=5, delay=7, random_delay=True),
    tasks.Palindrome(seq_len=20, alphabet_size=6),
    tasks.Stack(seq_len=40, num_stacks=4, num_values=5),
    tasks.Parity(seq_len=30),
], ids=["mqar", "delayed_copy", "palindrome", "stack", "parity"])
def test_deterministic_per_seed_and_streams_differ(task):
  def draw(seed, stream, index):
    return task.sample(tasks.rng(seed, stream, index), 8).as_dict()

  a, again = draw(3, tasks.TRAIN_STREAM, 7), draw(3, tasks.TRAIN_STREAM, 7)
  for key in a:
    np.testing.assert_array_equal(a[key], again[key])
  for other in (draw(4, tasks.TRAIN_STREAM, 7), draw(3, tasks.TRAIN_STREAM, 8),
                draw(3, tasks.EVAL_STREAM, 7)):
    assert not np.array_equal(a["inputs"], other["inputs"])
  with pytest.raises(ValueError, match="seed"):
    tasks.rng(-1, 0, 0)


def _decode_palindrome(inputs, alphabet_size):
  """Targets and mask of one row, recomputed from its inputs alone."""
  t = len(inputs)
  sep = [i for i, tok in enumerate(inputs) if tok == 1]
  assert len(sep) == 1, "exactly one separator"
  n = sep[0]
  assert n == t // 2
  string = list(inputs[:n])
  assert all(2 <= s <= alphabet_size + 1 for s in string)
  targets, mask = [0] * t, [0.0] * t
  for j in range(n):  # position n + j predicts the (j+1)-th symbol from the end
    targets[n + j] = string[n - 1 - j]
    mask[n + j] = 1.0
    if j + 1 < n:  # teacher forcing: the next input is this target
      assert inputs[n + j + 1] == string[n - 1 - j]
  assert all(tok == 0 for tok in inputs[2 * n:])
  return targets, mask


@pytest.mark.parametrize("seq_len", [2, 9, 64, 257])
def test_palindrome_targets_match_an_independent_decoder(seq_len):
  task = tasks.Palindrome(seq_len=seq_len, alphabet_size=5)
  b = task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 3), 16)
  assert b.inputs.shape == (16, seq_len) and task.vocab_size == 7
  for row in range(16):
    targets, mask = _decode_palindrome(b.inputs[row].tolist(), 5)
    np.testing.assert_array_equal(b.targets[row], targets)
    np.testing.assert_array_equal(b.mask[row], mask)
  assert b.mask.sum() == 16 * (seq_len // 2)


def test_palindrome_worked_example_and_statistics():
  task = tasks.Palindrome(seq_len=8, alphabet_size=4)
  b = task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 1)
  x = b.inputs[0, :4]
  np.testing.assert_array_equal(b.inputs[0, 4:],
                                [1, x[3], x[2], x[1]])
  np.testing.assert_array_equal(b.targets[0, 4:], x[::-1])
  assert task.chance_accuracy == pytest.approx(1 / 4)
  big = tasks.Palindrome(seq_len=512, alphabet_size=8).sample(
      tasks.rng(1, tasks.TRAIN_STREAM, 0), 64)
  counts = np.bincount(big.targets[big.mask == 1], minlength=10)[2:]
  assert counts.min() > 0.8 * counts.mean()  # letters uniform
  with pytest.raises(ValueError, match="task.alphabet_size"):
    tasks.Palindrome(alphabet_size=1)
  with pytest.raises(ValueError, match="task.seq_len"):
    tasks.Palindrome(seq_len=1)


def _decode_stack(inputs, num_stacks, num_values):
  """Targets and mask of one row from a plain Python stack simulation.

  Parses the token stream (PUSH id x / POP id, then filler), keeps one
  Python list per stack id, and checks that the stream is well formed.
  """
  first_value = 3 + num_stacks
  stacks = {s: [] for s in range(3, 3 + num_stacks)}
  t = len(inputs)
  targets, mask = [0] * t, [0.0] * t
  i, pushes, pops = 0, 0, 0  # operations chosen while a POP was possible
  while i < t and inputs[i] != 0:
    op = inputs[i]
    free_choice = any(stacks.values()) and t - i >= 3
    if op == 1:
      sid, value = inputs[i + 1], inputs[i + 2]
      assert sid in stacks, (i, sid)
      assert first_value <= value < first_value + num_values, (i, value)
      stacks[sid].append(value)
      pushes += free_choice
      i += 3
    elif op == 2:
      sid = inputs[i + 1]
      assert stacks[sid], f"POP of the empty stack {sid} at {i}"
      targets[i + 1] = stacks[sid].pop()
      mask[i + 1] = 1.0
      pops += free_choice
      i += 2
    else:
      raise AssertionError(f"token {op} at {i} is not an operation")
  assert all(tok == 0 for tok in inputs[i:])
  # The stream stops only when no operation fits.
  assert t - i < 2 or (t - i == 2 and not any(stacks.values()))
  return targets, mask, pushes, pops


@pytest.mark.parametrize("seq_len,num_stacks,p", [
    (5, 1, 0.5), (64, 4, 0.5), (257, 64, 0.5), (300, 3, 0.2), (128, 8, 0.9)])
def test_stack_targets_match_a_python_stack_simulation(seq_len, num_stacks, p):
  task = tasks.Stack(seq_len=seq_len, num_stacks=num_stacks, num_values=6,
                     push_probability=p)
  b = task.sample(tasks.rng(2, tasks.TRAIN_STREAM, 1), 24)
  assert task.vocab_size == 3 + num_stacks + 6
  assert b.inputs.shape == (24, seq_len)
  pushes = pops = 0
  for row in range(24):
    targets, mask, n_push, n_pop = _decode_stack(b.inputs[row].tolist(),
                                                 num_stacks, 6)
    np.testing.assert_array_equal(b.targets[row], targets)
    np.testing.assert_array_equal(b.mask[row], mask)
    pushes, pops = pushes + n_push, pops + n_pop
  assert b.mask.sum() > 0
  if seq_len >= 128:  # the mix of operations follows push_probability
    assert abs(pushes / (pushes + pops) - p) < 0.1, pushes / (pushes + pops)


def test_stack_worked_example_and_validation():
  task = tasks.Stack(seq_len=12, num_stacks=2, num_values=3)
  assert (task.first_value, task.vocab_size) == (5, 8)
  assert task.chance_accuracy == pytest.approx(1 / 3)
  # A deep single stack: pops return values in reverse push order.
  deep = tasks.Stack(seq_len=400, num_stacks=1, num_values=50,
                     push_probability=0.7)
  b = deep.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 4)
  for row in range(4):
    targets, _, _, _ = _decode_stack(b.inputs[row].tolist(), 1, 50)
    np.testing.assert_array_equal(b.targets[row], targets)
  for field, kw in (("task.num_stacks", dict(num_stacks=0)),
                    ("task.num_values", dict(num_values=1)),
                    ("task.push_probability", dict(push_probability=1.0)),
                    ("task.seq_len", dict(seq_len=4))):
    with pytest.raises(ValueError, match=field):
      tasks.Stack(**kw)


def test_stack_baseline_recalls_the_last_push_and_ignores_pops():
  task = tasks.Stack(seq_len=13, num_stacks=2, num_values=3)
  # PUSH A p, PUSH B q, PUSH A r, POP A (r: the last push, right), POP A (p;
  # the last push is still r: wrong).
  inputs = np.array([[1, 3, 5, 1, 4, 6, 1, 3, 7, 2, 3, 2, 3],
                     # PUSH A p, PUSH A p, POP A, POP A, PUSH B q: both
                     # right, the second by an older value equal to the last.
                     [1, 3, 5, 1, 3, 5, 2, 3, 2, 3, 1, 4, 6]], np.int32)
  targets = np.zeros_like(inputs)
  mask = np.zeros(inputs.shape, np.float32)
  targets[0, [10, 12]], targets[1, [7, 9]] = (7, 5), (5, 5)
  mask[0, [10, 12]] = mask[1, [7, 9]] = 1
  batch = tasks.Batch(inputs=inputs, targets=targets, mask=mask)
  for row in range(2):  # the hand-written targets are the task's own
    want, want_mask, _, _ = _decode_stack(inputs[row].tolist(), 2, 3)
    np.testing.assert_array_equal(targets[row], want)
    np.testing.assert_array_equal(mask[row], want_mask)
  np.testing.assert_array_equal(
      np.nonzero(task.baseline_correct(batch)), ([0, 1, 1], [10, 7, 9]))
  assert tasks.baseline_accuracy(task, [batch]) == pytest.approx(3 / 4)
  assert tasks.baseline_accuracy(tasks.Palindrome(), [batch]) is None
  # With far more stacks than operations a stack is almost never popped
  # twice, so the last push is almost always the answer; with one stack
  # and mostly pushes it is often an older value.
  wide = tasks.Stack(seq_len=256, num_stacks=100_000, num_values=16)
  b = wide.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 8)
  assert tasks.baseline_accuracy(wide, [b]) > 0.97
  deep = tasks.Stack(seq_len=256, num_stacks=1, num_values=16,
                     push_probability=0.5)
  b = deep.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 8)
  assert tasks.baseline_accuracy(deep, [b]) < 0.7


@pytest.mark.parametrize("seq_len", [1, 2, 37, 300])
def test_parity_targets_match_a_counter_of_ones(seq_len):
  task = tasks.Parity(seq_len=seq_len)
  b = task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 5), 16)
  assert b.inputs.shape == (16, seq_len) and task.vocab_size == 3
  for row in range(16):
    ones = 0
    for t, tok in enumerate(b.inputs[row].tolist()):
      assert tok in (1, 2), "every position holds a bit"
      ones += tok == 2
      assert b.targets[row, t] == (2 if ones % 2 else 1), (row, t)
  np.testing.assert_array_equal(b.mask, 1.0)


def test_parity_worked_example_and_statistics():
  task = tasks.Parity(seq_len=6)
  assert task.chance_accuracy == 0.5
  b = task.sample(tasks.rng(0, tasks.TRAIN_STREAM, 0), 1)
  bits = b.inputs[0] - 1
  np.testing.assert_array_equal(b.targets[0] - 1, np.cumsum(bits) % 2)
  big = tasks.Parity(seq_len=512).sample(tasks.rng(1, tasks.TRAIN_STREAM, 0),
                                         64)
  # Bits and late parities are balanced: a memoryless model is at 1/2.
  assert abs((big.inputs == 2).mean() - 0.5) < 0.01
  assert abs((big.targets[:, 64:] == 2).mean() - 0.5) < 0.02
  with pytest.raises(ValueError, match="task.seq_len"):
    tasks.Parity(seq_len=0)
