"""The training loop of one (task, model) config, resumable.

`train_and_evaluate(config, workdir)` trains `config.model` on `config.task`
and writes into `workdir`:

* `config.json`: the config as run;
* `metrics.jsonl`: one JSON object per logged step (`split` "train": loss,
  accuracy, steps_per_second, tokens_per_second, learning_rate, grad_norm;
  `split` "eval": held-out loss and accuracy);
* `tb/`: the same scalars for TensorBoard (tensorboardX);
* `checkpoints/`: orbax checkpoints of (params, optimizer state) every
  `train.checkpoint_every` steps and at the end;
* `summary.json`: task, mixer, backend, seed, steps, final / best held-out
  accuracy, chance accuracy, wall seconds and steps per second (of this
  invocation), steps to 99%; with `train.eval_lengths`, `length_accuracy`
  and `length_loss`: the final parameters' held-out accuracy and loss at
  each of those lengths; for text, `corpus` (its fingerprint, also in
  `corpus.json`: a run does not resume on another corpus);
* `accuracy.png`: held-out accuracy against step.

The pieces live by concern: `experiments/training/program.py` (config checks,
model, optimiser, jitted steps), `experiments/training/metrics.py` (the metrics
log), `experiments/training/checkpoints.py` (orbax),
`experiments/training/resume.py` (whether a workdir's run is finished, and
where it resumes); this file is the loop.

Several processes (`jax.distributed.initialize` before the first JAX call,
as `run_experiment.py` does with its distributed flags): every process runs
this same loop on the mesh spanning all devices; the batches, parameters and
metrics are the single-process run's (`experiments/training/program.py`); only
process 0 writes config.json, metrics, TensorBoard, plots and the summary,
and every process takes part in orbax's checkpoint saves and restores (the
workdir must be a path all processes share).

Data is a pure function of (seed, step): the training batch of step s comes
from `tasks.rng(seed, TRAIN_STREAM, s)`, the held-out set from the separate
`EVAL_STREAM`. With `train.length_curriculum`, the first steps draw from the
task at shorter (or other) lengths, the same tokens a step; the held-out set
stays at the task's length. Each batch is drawn in a thread while the step
before runs, and the loop waits on the device only to log, evaluate or save
(non-finite gradients are still reported at the step they happened).

Rerunning with the same workdir restores the latest readable checkpoint,
drops metrics logged after it and continues, so a killed run loses at most
one checkpoint interval and ends with the same metrics as an uninterrupted
one (docs/reliability.md). A workdir resumes only with the config it was
started with (ValueError naming the changed fields otherwise); the backend,
the mesh and the logging and checkpoint intervals may change
(`resume.RESUMABLE_FIELDS`), and so may `train.num_steps` under a
"constant" or "wsd" schedule (`resume.EXTENDABLE_SCHEDULES`): a run that did not reach its
stop_at_accuracy then continues to the new cap as the longer run would.
"""

import concurrent.futures
import json
import os
import time
from typing import Any

from absl import logging
import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import tasks as tasks_lib
from experiments.training import checkpoints
from experiments.training import distributed
from experiments.training import metrics as metrics_lib
from experiments.training import model as model_lib
from experiments.training import plotting
from experiments.training import program as program_lib
from experiments.training import resume

# The names the CLIs and tests use, from the modules that define them.
build_program = program_lib.build_program
quiet_orbax_logs = checkpoints.quiet_orbax_logs
check_folder = metrics_lib.check_folder
validate_config = program_lib.validate_config


def eval_set(config, task) -> list[dict[str, np.ndarray]]:
  """The run's held-out batches at `task`'s length: `train.eval_batches` of
  its seed's EVAL_STREAM (the same for every mixer at that seed).

  With `train.eval_score_last`, the batches are drawn once at the longest
  length of the run (task.seq_len and train.eval_lengths) and cut to the
  last `task.seq_len` positions (`task.cut`), scoring only the last
  `eval_score_last` targets: every length scores the same bytes, the longer
  ones with more context in front. Otherwise each length draws its own.
  """
  tr = config.train
  score_last = tr.get("eval_score_last")
  if score_last is None:
    source, cut = tasks_lib.held_out(task), lambda batch: batch
  else:
    longest = max([config.task.seq_len, *tr.get("eval_lengths", ())])
    source = tasks_lib.held_out(_task_at(config, longest))
    cut = lambda batch: source.cut(batch, task.seq_len, score_last)
  return [cut(source.sample(
      tasks_lib.rng(config.seed, tasks_lib.EVAL_STREAM, i),
      tr.eval_batch_size)).as_dict() for i in range(tr.eval_batches)]


def _evaluate(prog, params, eval_batches) -> tuple[float, float]:
  """(loss, accuracy) over the held-out set, weighted by scored tokens."""
  losses, accs, counts = [], [], []
  for batch in eval_batches:
    loss, acc = jax.device_get(prog.eval_step(params, prog.put_batch(batch)))
    losses.append(loss)
    accs.append(acc)
    counts.append(batch["mask"].sum())
  w = np.asarray(counts) / np.sum(counts)
  return float(np.dot(w, losses)), float(np.dot(w, accs))


def _task_at(config, seq_len: int):
  """The config's task with only `seq_len` replaced."""
  return tasks_lib.make_task(**dict(config.task.to_dict(), seq_len=seq_len))


def train_batches(config, task):
  """step -> the training batch of that step (0-based), as NumPy arrays.

  A pure function of (seed, step): `tasks.rng(seed, TRAIN_STREAM, step)`
  drawn from the task, or from the task at a curriculum stage's length
  (`train.length_curriculum`) while the step is inside that stage.
  """
  stages = [(end, _task_at(config, seq_len), b)
            for end, b, seq_len in program_lib.curriculum_shapes(config)]
  for (end, stage_task, b), start in zip(stages, [0] + [s[0] for s in stages]):
    logging.info("Length curriculum: steps %d-%d at T=%d (%d sequences a"
                 " step).", start + 1, end, stage_task.seq_len, b)

  def batch(step: int) -> dict[str, np.ndarray]:
    rng = tasks_lib.rng(config.seed, tasks_lib.TRAIN_STREAM, step)
    for end, stage_task, b in stages:
      if step < end:
        return stage_task.sample(rng, b).as_dict()
    return task.sample(rng, config.train.batch_size).as_dict()

  return batch


def _length_evals(config, prog, params) -> dict[str, dict[str, float]]:
  """Held-out accuracy and loss of `params` at each of `train.eval_lengths`.

  The same task with only `seq_len` replaced, drawn from the held-out stream
  (`eval_set`: with `train.eval_score_last`, the same scored bytes at every
  length); the eval step compiles once per length.
  """
  accuracy, loss = {}, {}
  for seq_len in config.train.get("eval_lengths", ()):
    loss[str(seq_len)], accuracy[str(seq_len)] = _evaluate(
        prog, params, eval_set(config, _task_at(config, seq_len)))
    logging.info("Length generalisation: T=%d held-out accuracy %.4f, loss"
                 " %.4f.", seq_len, accuracy[str(seq_len)],
                 loss[str(seq_len)])
  return dict(length_accuracy=accuracy, length_loss=loss)


class Prefetch:
  """The training batches, each drawn in a thread while the step before runs.

  Batches are NumPy work (a Python loop per row for Stack); drawn here,
  they overlap the device's step instead of following it.
  """

  def __init__(self, batch_fn, start: int, stop: int):
    self._fn, self._stop = batch_fn, stop
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._next = self._submit(start)

  def _submit(self, step: int):
    return self._pool.submit(self._fn, step) if step < self._stop else None

  def get(self, step: int) -> dict[str, np.ndarray]:
    """The batch of `step`; steps are asked for in order."""
    batch = self._next.result()
    self._next = self._submit(step + 1)
    return batch

  def close(self) -> None:
    self._pool.shutdown(cancel_futures=True)


def _check_finite(unchecked, batches: Prefetch) -> None:
  """Raises FloatingPointError naming the first step with non-finite
  gradients among `unchecked` ((step, flag on the device) pairs).

  The loop syncs with the device only to log, evaluate or save, so a
  divergence is caught there, at the step it happened, before its
  parameters are evaluated or saved.
  """
  flags = jax.device_get([flag for _, flag in unchecked])
  for (step, _), finite in zip(unchecked, flags):
    if not finite:
      batches.close()
      raise FloatingPointError(f"Non-finite gradients at step {step}.")


def _log_train(log, schedule, m, step, done, total, window, b, t) -> None:
  now = time.time()
  sps = window[1] / max(now - window[0], 1e-9)
  log.write(dict(step=done, split="train", loss=float(m["loss"]),
                 accuracy=float(m["accuracy"]),
                 grad_norm=float(m["grad_norm"]),
                 learning_rate=float(schedule(step)),
                 steps_per_second=sps, tokens_per_second=sps * b * t))
  logging.info(
      "step %d/%d  loss %.4f  acc %.4f  %.2f steps/s  %.0f tokens/s  "
      "ETA %.0f s", done, total, m["loss"], m["accuracy"], sps, sps * b * t,
      (total - done) / max(sps, 1e-9))


def _summary(config, task, params, log, *, last, start, wall):
  tr = config.train
  evals = log.evals()
  trained = last - start
  return dict(
      task=task.name, mixer=config.model.mixer,
      backend=model_lib.kda_backend(config.model), seed=config.seed, steps=last,
      final_eval_accuracy=evals[-1]["accuracy"] if evals else None,
      final_eval_loss=evals[-1]["loss"] if evals else None,
      best_eval_accuracy=max((r["accuracy"] for r in evals), default=None),
      chance_accuracy=task.chance_accuracy,
      steps_to_99=metrics_lib.steps_to_accuracy(evals),
      learning_rate=tr.learning_rate, batch_size=tr.batch_size,
      seq_len=task.seq_len, mesh=[config.mesh.data, config.mesh.context],
      num_params=model_lib.count_params(params),
      wall_seconds=wall, steps_per_second=trained / wall if trained else None,
      steps_trained_this_run=trained,
      schedule=tr.schedule, num_steps=tr.num_steps,
      status=metrics_lib.run_status(
          log.records, rule=tr.get("status_rule", "accuracy")),
      train_seconds=metrics_lib.train_seconds(log.records),
      device=_device_name(),
      **_fingerprint(task))


def _device_name() -> str:
  """What this process trained on: "cpu", "TPU v5 lite", "8 x cpu"."""
  kind, count = jax.devices()[0].device_kind, jax.device_count()
  return kind if count == 1 else f"{count} x {kind}"


def _fingerprint(task) -> dict[str, Any]:
  """{"corpus": ...} for a task on real data (`text`), else {}."""
  return {"corpus": task.fingerprint()} if hasattr(task, "fingerprint") else {}


def _write_outputs(config, task, workdir, summary, evals) -> None:
  if jax.process_index() != 0:
    return
  metrics_lib.write_atomic(os.path.join(workdir, "summary.json"),
                           json.dumps(summary, indent=2))
  plotting.plot_accuracy(
      {config.model.mixer: ([r["step"] for r in evals],
                            [r["accuracy"] for r in evals])},
      chance=task.chance_accuracy, path=os.path.join(workdir, "accuracy.png"),
      title=f"{task.name}: {config.model.mixer} (seed {config.seed})")


def _train_loop(config, prog, ckpt, log, eval_batches, params, opt_state,
                start, last):
  """Steps `start + 1 .. last`, logging, evaluating and saving on the way.

  Returns the parameters and the last step trained (before `last` when the
  held-out accuracy reached train.stop_at_accuracy).
  """
  tr = config.train
  b, t = tr.batch_size, prog.task.seq_len
  decay_start = program_lib.decay_start(tr)
  window = [time.time(), 0]  # (start time, steps) of the logging window
  batches = Prefetch(train_batches(config, prog.task), start, last)
  unchecked = []  # (step, grads_finite on the device) since the last sync
  for step in range(start, last):
    params, opt_state, m = prog.train_step(params, opt_state,
                                           prog.put_batch(batches.get(step)))
    done = step + 1
    unchecked.append((done, m.pop("grads_finite")))
    window[1] += 1
    logs = done % tr.log_every == 0 or done == last
    evaluates = done % tr.eval_every == 0 or done == tr.num_steps
    saves = done % tr.checkpoint_every == 0 or done in (tr.num_steps,
                                                         decay_start)
    if not (logs or evaluates or saves):
      continue  # no host sync: the device runs ahead, batches come in
    _check_finite(unchecked, batches)  # before anything reads the params
    unchecked = []
    if logs:
      m = jax.device_get(m)
      chex.assert_tree_all_finite(m)
      _log_train(log, prog.schedule, m, step, done, tr.num_steps, window, b, t)
      window = [time.time(), 0]
    solved = False
    if evaluates:
      loss, acc = _evaluate(prog, params, eval_batches)
      log.write(dict(step=done, split="eval", loss=loss, accuracy=acc))
      logging.info("step %d  held-out loss %.4f  accuracy %.4f", done, loss,
                   acc)
      solved = (tr.stop_at_accuracy is not None
                and acc >= tr.stop_at_accuracy)
    if saves or solved:
      checkpoints.save(ckpt, done, params, opt_state)
    if solved:
      logging.info("Held-out accuracy %.4f >= train.stop_at_accuracy %.4f at"
                   " step %d: stopping.", acc, tr.stop_at_accuracy, done)
      last = done
      break
  batches.close()
  return params, last


def check_run(config: ml_collections.ConfigDict, workdir: str
              ) -> ml_collections.ConfigDict:
  """What `train_and_evaluate` checks before it runs or writes anything:
  ValueError naming the first bad field of `config`, a workdir that is a
  file, or one that holds a run of another config (`check_resumable`).
  Returns the config with canonical backend names (what a run records and
  compares with a saved run's)."""
  program_lib.validate_config(config)
  config = program_lib.with_canonical_names(config)  # e.g. "mosaic"
  check_folder(workdir)
  resume.check_resumable(workdir, config)
  return config


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_at_step: int | None = None) -> dict[str, Any]:
  """Trains, evaluates and checkpoints; returns the summary dict.

  Args:
    config: the experiment config (see configs/mqar.py).
    workdir: output directory; an existing one is resumed.
    stop_at_step: stop after this step without the final checkpoint or
      summary, as if the process were killed there (for resume tests).

  Returns:
    The contents of summary.json (None values for an interrupted run's
    summary fields are not written; the dict is returned regardless).
  """
  config = check_run(config, workdir)
  with model_lib.host_context(config.model):  # e.g. Mosaic off TPU
    return _train_and_evaluate(config, workdir, stop_at_step)


def _train_and_evaluate(config, workdir, stop_at_step):
  workdir = os.path.abspath(workdir)
  tr = config.train
  # Built before the workdir is made: a config that cannot run here (a mesh
  # of more devices than there are) leaves nothing behind.
  prog = program_lib.build_program(config)
  os.makedirs(workdir, exist_ok=True)
  task = prog.task
  resume.check_corpus(workdir, task)
  stored = resume.stored_config(workdir)
  # Every process has read the stored config before process 0 replaces it.
  distributed.line_up("config checked")
  logging.info("Task %s: T=%d, vocab %d, chance accuracy %.4f.", task.name,
               task.seq_len, task.vocab_size, task.chance_accuracy)
  if config.mesh.data * config.mesh.context > 1:
    logging.info("Mesh: data %d x context %d devices (batch split over data,"
                 " sequence over context).", config.mesh.data,
                 config.mesh.context)
  eval_batches = eval_set(config, task)

  params = prog.init(jax.random.key(config.seed),
                     jnp.zeros((1, task.seq_len), jnp.int32))
  opt_state = prog.init_opt(params)
  logging.info("Model: mixer %s, %d parameters, KDA backend %s.",
               config.model.mixer, model_lib.count_params(params),
               model_lib.kda_backend(config.model))

  decay_start = program_lib.decay_start(tr)
  ckpt = checkpoints.manager(
      workdir, keep_steps=() if decay_start is None else (decay_start,))
  previous = resume.finished_summary(workdir, ckpt, config)
  if previous is not None:
    ckpt.close()
    logging.info("%s already finished (%d steps); nothing to do.", workdir,
                 previous["steps"])
    return previous
  if jax.process_index() == 0:
    metrics_lib.write_atomic(
        os.path.join(workdir, "config.json"),
        config.to_json_best_effort(indent=2, sort_keys=True))
  start, params, opt_state = resume.restore(workdir, ckpt, tr, stored,
                                            params, opt_state)
  log = metrics_lib.MetricsLog(workdir, start,
                               writer=jax.process_index() == 0)
  last = tr.num_steps if stop_at_step is None else min(stop_at_step,
                                                       tr.num_steps)
  if start == 0 and not log.evals():  # a restart from 0 logged it already
    loss, acc = _evaluate(prog, params, eval_batches)
    log.write(dict(step=0, split="eval", loss=loss, accuracy=acc))

  t0 = time.time()
  params, last = _train_loop(config, prog, ckpt, log, eval_batches, params,
                             opt_state, start, last)
  ckpt.wait_until_finished()
  ckpt.close()
  summary = _summary(config, task, params, log, last=last, start=start,
                     wall=time.time() - t0)
  log.close()
  if stop_at_step is not None and last == stop_at_step < tr.num_steps:
    logging.info("Stopped at step %d of %d (stop_at_step).", last,
                 tr.num_steps)
    return summary
  if tr.get("eval_lengths"):
    summary.update(_length_evals(config, prog, params))
  _write_outputs(config, task, workdir, summary, log.evals())
  logging.info("Done: %s", json.dumps(summary))
  return summary
