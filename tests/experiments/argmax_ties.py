"""The tie allowance of an accuracy that two compiled programs computed.

An accuracy is a mean of argmax hits over the scored positions. Two
programs (another fusion or summation order, a mesh, another process count)
round the same float32 logits differently, and two runs trained by them hold
parameters that drifted apart by rounding; so their accuracies agree except
at positions whose top two logits are closer than that. `allowance` counts
those positions, and `assert_same_hits` lets the two hit counts differ by at
most that many: with no such position, they must be equal.

The bound. Let c_a, c_b be the two runs' parameters' logits in float64
(the model run on float64 parameters; a few steps inside KDA, its beta and
output norm statistics, stay float32), D = max |c_a - c_b| over the scored
positions, and R a bound on how far a float32 program's logits lie from the
float64 ones of the same parameters. Program a's logits lie within R of c_a,
program b's within R + D; a vector within r of c_a (every entry) has c_a's
argmax unless c_a's top-two gap is <= 2 r. So a position can score
differently only where that gap is <= 2 (R + D). R is measured:
e = max |float32 jit - float64| over the scored positions, taken as R = 2 e
for the runs' own programs, which a test cannot read (on the MQAR smoke
model the fused jit, op-by-op and 2 x 2 mesh forwards lay 0.8e-7 to 2.3e-7
from the float64 logits, within 1.3x of one another).
"""

import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks as tasks_lib
from experiments.training import model as model_lib
from experiments.training import program as program_lib
from experiments.training import train
from linear_attention import testing


def _float64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def allowance(model, params_a, params_b, batches,
              drift: float | None = None) -> tuple[int, dict]:
  """(scored positions that may score differently, the measured bounds).

  Args:
    model: the Haiku model both runs apply (`model.apply(params, inputs)`
      on one device: no context axis).
    params_a, params_b: the two runs' parameters at the step compared (the
      same ones when both programs scored one set of parameters); params_b
      None where it was not saved: then `drift` bounds D.
    batches: the batches scored ({"inputs", "mask"} NumPy arrays).
    drift: a bound on D where params_b is None.

  Returns:
    (count, dict(rounding=e, drift=D, tolerance=2 (2 e + D), min_gap:
    the smallest top-two gap of c_a)).
  """
  params = [_float64(jax.device_get(p)) for p in (params_a, params_b)
            if p is not None]
  f32 = jax.jit(model.apply)
  f64 = jax.jit(model.apply)  # traced again under x64
  count, rounding, most, min_gap = 0, 0.0, 0.0, np.inf
  tolerance = []
  for batch in batches:
    scored = batch["mask"] > 0
    # float64 on the host's CPU: a TPU emulates it (slowly).
    with testing.float64_on_host():
      centre = [np.asarray(f64(p, batch["inputs"])) for p in params]
    low = [np.asarray(f32(jax.tree.map(np.float32, p), batch["inputs"]))
           for p in params]
    e = max(float(np.abs(lo - x)[scored].max()) for lo, x in zip(low, centre))
    d = (drift if params_b is None else
         float(np.abs(centre[0] - centre[1])[scored].max()))
    top2 = np.sort(centre[0][scored], axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    tolerance.append(2 * (2 * e + d))
    count += int((gap <= tolerance[-1]).sum())
    rounding, most = max(rounding, e), max(most, d)
    min_gap = min(min_gap, float(gap.min()))
  return count, dict(rounding=rounding, drift=most,
                     tolerance=max(tolerance), min_gap=min_gap)


def hits(accuracy: float, batches) -> int:
  """The number of hits behind an accuracy over `batches`' scored positions
  (a float32 ratio, or a mean of them weighted by scored positions)."""
  n = sum(int((b["mask"] > 0).sum()) for b in batches)
  count = accuracy * n
  assert abs(count - round(count)) < 1e-3, (accuracy, n)
  return round(count)


def assert_same_hits(accuracy_a, accuracy_b, model, params_a, params_b,
                     batches, what="", drift: float | None = None):
  """The two accuracies' hit counts differ by at most `allowance`; returns
  it and its bounds."""
  ties, bounds = allowance(model, params_a, params_b, batches, drift)
  a, b = hits(accuracy_a, batches), hits(accuracy_b, batches)
  assert abs(a - b) <= ties, (what, a, b, ties, bounds)
  return ties, bounds


def replay(config) -> tuple[list, list[float]]:
  """(parameters before each step and after the last, each step's training
  loss) of a run of `config`, trained again by the same compiled program
  (`build_program` keeps it): the run's own values, as its logged losses
  show."""
  prog = program_lib.build_program(config)
  params = prog.init(jax.random.key(config.seed),
                     jnp.zeros((1, prog.task.seq_len), jnp.int32))
  opt_state = prog.init_opt(params)
  batch = train.train_batches(config, prog.task)
  trace, losses = [jax.device_get(params)], []
  for step in range(config.train.num_steps):
    params, opt_state, m = prog.train_step(params, opt_state,
                                           prog.put_batch(batch(step)))
    trace.append(jax.device_get(params))
    losses.append(float(m["loss"]))
  return trace, losses


def assert_same_run_accuracies(config, actual, expected, params_actual,
                               params_expected, what=""):
  """Each logged accuracy of two runs of `config` has the same hits but at
  near-ties.

  Args:
    config: the config both runs trained.
    actual, expected: their records (step, split, loss, accuracy), in the
      same order.
    params_actual, params_expected: step -> the run's parameters after that
      step (`replay`'s list, or a dict). At a step params_actual lacks (not
      saved), its drift from params_expected is taken as the largest at the
      steps it has: rounding differences that accumulate step by step (the
      two-process MQAR smoke run's: 2.2e-8, 4.9e-8, 9.2e-8 at steps 2, 4,
      6).
    what: named in a failure.
  """
  task = tasks_lib.make_task(**config.task.to_dict())
  model = model_lib.make_model(config.model, task.vocab_size)
  batch = train.train_batches(config, task)
  held_out = train.eval_set(config, task)
  params_actual, params_expected = (
      p if isinstance(p, dict) else dict(enumerate(p))
      for p in (params_actual, params_expected))
  records = []
  for a, e in zip(actual, expected):
    step, split = e[:2]
    k = step - 1 if split == "train" else step  # the parameters it scored
    batches = [batch(step - 1)] if split == "train" else held_out
    records.append((a[3], e[3], k, batches, (what, step, split)))
  assert any(r[2] in params_actual for r in records), "no drift measured"
  drift = 0.0
  for saved in (True, False):  # the drift measured first
    for a, e, k, batches, name in records:
      if (k in params_actual) == saved:
        _, bounds = assert_same_hits(
            e, a, model, params_expected[k], params_actual.get(k), batches,
            name, drift=None if saved else drift)
        drift = max(drift, bounds["drift"])
