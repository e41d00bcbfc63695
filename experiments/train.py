"""Training and evaluation of one (task, model) config, resumable.

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
  invocation), steps to 99%;
* `accuracy.png`: held-out accuracy against step.

Data is a pure function of (seed, step): the training batch of step s comes
from `tasks.rng(seed, TRAIN_STREAM, s)`, the held-out set from the separate
`EVAL_STREAM`. Rerunning with the same workdir restores the latest checkpoint,
drops metrics logged after it and continues, so a killed run loses at most
one checkpoint interval and ends with the same metrics as an uninterrupted one.
"""

import collections
import contextlib
import copy
import dataclasses
import json
import logging as logging_std
import math
import os
import time
from typing import Any

from absl import logging
import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorboardX

from experiments import model as model_lib
from experiments import plotting
from experiments import tasks as tasks_lib
from linear_attention.parallel import train as parallel_train

KDA_MIXERS = ("kda", "kda_zeroed", "gdn")
TARGET_ACCURACY = 0.99  # "solved": steps to this held-out accuracy


def _check(name: str, ok: bool, want: str, value: Any) -> None:
  if not ok:
    raise ValueError(f"{name} must be {want}; got {value!r}.")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field of `config`."""
  for section in ("task", "model", "train"):
    _check(section, section in config, "a section of the config", None)
  _check("seed", _is_int(config.seed) and config.seed >= 0, "an int >= 0",
         config.seed)
  tr = config.train
  for field, low in (("num_steps", 1), ("batch_size", 1), ("log_every", 1),
                     ("eval_every", 1), ("eval_batches", 1),
                     ("eval_batch_size", 1), ("checkpoint_every", 1),
                     ("warmup_steps", 0)):
    _check(f"train.{field}", _is_int(tr[field]) and tr[field] >= low,
           f"an int >= {low}", tr[field])
  for field in ("learning_rate", "grad_clip"):
    _check(f"train.{field}",
           isinstance(tr[field], (int, float)) and tr[field] > 0
           and math.isfinite(tr[field]), "a positive number", tr[field])
  _check("train.weight_decay",
         isinstance(tr.weight_decay, (int, float)) and tr.weight_decay >= 0,
         "a number >= 0", tr.weight_decay)
  _check("train.final_lr_fraction",
         isinstance(tr.final_lr_fraction, (int, float))
         and 0 <= tr.final_lr_fraction <= 1, "in [0, 1]", tr.final_lr_fraction)
  _check("train.stop_at_accuracy", tr.stop_at_accuracy is None or (
      0 < tr.stop_at_accuracy <= 1), "None or in (0, 1]", tr.stop_at_accuracy)
  _check("train.warmup_steps", tr.warmup_steps < tr.num_steps,
         f"< train.num_steps ({tr.num_steps})", tr.warmup_steps)
  _check("mesh", "mesh" in config, "a section of the config", None)
  for field in ("data", "context"):
    value = config.mesh[field]
    _check(f"mesh.{field}", _is_int(value) and value >= 1, "an int >= 1",
           value)
  for field in ("batch_size", "eval_batch_size"):
    _check(f"train.{field}", tr[field] % config.mesh.data == 0,
           f"a multiple of mesh.data ({config.mesh.data})", tr[field])
  if config.mesh.context > 1:
    if config.model.mixer == "attention":
      raise NotImplementedError(
          "model.mixer='attention' (the softmax baseline) has no context"
          " parallelism; use mesh.context=1 for it.")
    if uses_kda(config) and config.model.kda.context_axis is not None:
      raise ValueError(
          "model.kda.context_axis must be None: mesh.context sets it; got"
          f" {config.model.kda.context_axis!r}.")


def make_mesh(config) -> jax.sharding.Mesh | None:
  """The ("data", "context") Mesh of `config.mesh`, or None for 1 x 1."""
  data, context = config.mesh.data, config.mesh.context
  n = data * context
  if n == 1:
    return None
  available = jax.device_count()
  if n > available:
    raise ValueError(
        f"mesh.data * mesh.context ({data} x {context} = {n}) must be <= the"
        f" number of devices ({available}). On CPU, simulate devices with"
        f" XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
  devices = np.asarray(jax.devices()[:n]).reshape(data, context)
  return jax.sharding.Mesh(devices, ("data", "context"))


class _DropOrbaxInfo(logging_std.Filter):
  """Hides orbax's per-checkpoint INFO chatter; keeps its warnings."""

  def filter(self, record):
    return record.levelno > logging_std.INFO or "orbax" not in record.pathname


def quiet_orbax_logs() -> None:
  """For CLIs: keep the progress log readable (call once, in main)."""
  logging.get_absl_handler().addFilter(_DropOrbaxInfo())


def uses_kda(config) -> bool:
  return config.model.mixer in KDA_MIXERS


def kda_backend(config) -> str | None:
  """The KDA backend this run uses, or None when the mixer is not KDA."""
  return config.model.kda.backend if uses_kda(config) else None


def backend_context(config):
  """Mosaic interpret mode when the config asks for Mosaic off-TPU.

  The real tokamax Pallas kernel then runs in Pallas interpret mode (seconds
  per call: keep shapes tiny); on a TPU the kernel runs natively.
  """
  if kda_backend(config) == "mosaic" and jax.default_backend() != "tpu":
    logging.info(
        "KDA backend is mosaic and the default device is %s, not a TPU: "
        "running inside linear_attention.testing.mosaic_interpret_mode() "
        "(Pallas interpret mode, slow).", jax.default_backend())
    from linear_attention import testing  # pylint: disable=g-import-not-at-top
    return testing.mosaic_interpret_mode()
  return contextlib.nullcontext()


def make_optimizer(tr) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tr.learning_rate,
      warmup_steps=tr.warmup_steps, decay_steps=tr.num_steps,
      end_value=tr.learning_rate * tr.final_lr_fraction)
  # No weight decay on vectors (norm scales, biases, gates' scalars).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  opt = optax.chain(
      optax.clip_by_global_norm(tr.grad_clip),
      optax.adamw(schedule, b1=tr.b1, b2=tr.b2,
                  weight_decay=tr.weight_decay, mask=decay_mask))
  return opt, schedule


def masked_sums(logits, targets, mask):
  """(cross-entropy sum, number scored, correct sum) where mask is 1."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return (nll * mask).sum(), mask.sum(), (correct * mask).sum()


class MetricsLog:
  """metrics.jsonl + TensorBoard; on resume drops records after the step."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.records = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        self.records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in self.records if r["step"] <= resume_step]
    if len(kept) != len(self.records):
      logging.info("Dropping %d metric records logged after step %d.",
                   len(self.records) - len(kept), resume_step)
    self.records = kept
    with open(self.path, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    self.tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, record: dict[str, Any]) -> None:
    self.records.append(record)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key not in ("step", "split") and value is not None:
        self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

  def evals(self) -> list[dict[str, Any]]:
    return [r for r in self.records if r["split"] == "eval"]

  def close(self):
    self.tb.close()


def steps_to_accuracy(evals, target: float = TARGET_ACCURACY) -> int | None:
  """The first evaluated step whose held-out accuracy is >= target."""
  for r in evals:
    if r["accuracy"] >= target:
      return r["step"]
  return None


@dataclasses.dataclass(frozen=True)
class _Program:
  """What a config compiles to: task, model, optimiser and jitted steps."""

  task: Any
  model: Any
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  train_step: Any  # (params, opt_state, batch) -> (params, opt_state, metrics)
  eval_step: Any  # (params, batch) -> (loss, accuracy)
  init: Any  # (rng, tokens) -> params


# Reusing the jitted functions of an identical config (a resumed run, a test
# rerun) skips recompiling; a few entries at most.
_PROGRAMS: "collections.OrderedDict[str, _Program]" = collections.OrderedDict()
_MAX_PROGRAMS = 4


def build_program(config) -> _Program:
  """Builds (or reuses) the task, model and jitted steps for `config`."""
  key = config.to_json_best_effort(sort_keys=True)
  if key in _PROGRAMS:
    return _PROGRAMS[key]
  tr = config.train
  task = tasks_lib.make_task(**config.task.to_dict())
  mesh = make_mesh(config)
  model_config = config.model
  context = config.mesh.context
  if context > 1:
    _check("task.seq_len", task.seq_len % context == 0,
           f"a multiple of mesh.context ({context})", task.seq_len)
    if uses_kda(config):  # the layer runs KDA and its conv across ranks
      model_config = copy.deepcopy(config.model)
      model_config.kda.context_axis = "context"
  model = model_lib.make_model(model_config, task.vocab_size)
  # Parameters do not depend on the mesh: initialise them outside it.
  init_model = (model if model_config is config.model else
                model_lib.make_model(config.model, task.vocab_size))
  optimizer, schedule = make_optimizer(tr)
  b, t, v = tr.batch_size, task.seq_len, task.vocab_size

  def sums_fn(params, batch):  # on one shard of the mesh, or on everything
    logits = model.apply(params, batch["inputs"])
    chex.assert_shape(logits, (*batch["inputs"].shape, v))
    return masked_sums(logits, batch["targets"], batch["mask"])

  if mesh is None:
    def loss_fn(params, batch):
      nll, count, correct = sums_fn(params, batch)
      denom = jnp.maximum(count, 1.0)
      return nll / denom, correct / denom
  else:
    loss_fn = parallel_train.shard_loss_fn(
        sums_fn, mesh, "data", "context" if context > 1 else None,
        has_aux=True)

  @jax.jit
  def train_step(params, opt_state, batch):
    chex.assert_shape([batch["inputs"], batch["targets"], batch["mask"]],
                      (b, t))
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch)
    chex.assert_trees_all_equal_shapes(grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    all_finite = jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return params, opt_state, dict(loss=loss, accuracy=acc,
                                   grad_norm=optax.global_norm(grads),
                                   grads_finite=all_finite)

  prog = _Program(task=task, model=model, optimizer=optimizer,
                  schedule=schedule, train_step=train_step,
                  eval_step=jax.jit(loss_fn), init=jax.jit(init_model.init))
  _PROGRAMS[key] = prog
  while len(_PROGRAMS) > _MAX_PROGRAMS:
    _PROGRAMS.popitem(last=False)
  return prog


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
  validate_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  tr = config.train
  prog = build_program(config)
  task, model, optimizer, schedule = (prog.task, prog.model, prog.optimizer,
                                      prog.schedule)
  train_step, eval_step = prog.train_step, prog.eval_step
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  b, t = tr.batch_size, task.seq_len
  logging.info("Task %s: T=%d, vocab %d, chance accuracy %.4f.", task.name, t,
               task.vocab_size, task.chance_accuracy)
  if config.mesh.data * config.mesh.context > 1:
    logging.info("Mesh: data %d x context %d devices (batch split over data,"
                 " sequence over context).", config.mesh.data,
                 config.mesh.context)

  eval_set = [
      task.sample(tasks_lib.rng(config.seed, tasks_lib.EVAL_STREAM, i),
                  tr.eval_batch_size).as_dict()
      for i in range(tr.eval_batches)
  ]

  def evaluate(params):
    losses, accs, counts = [], [], []
    for batch in eval_set:
      loss, acc = jax.device_get(eval_step(params, batch))
      losses.append(loss)
      accs.append(acc)
      counts.append(batch["mask"].sum())
    w = np.asarray(counts) / np.sum(counts)
    return float(np.dot(w, losses)), float(np.dot(w, accs))

  init_tokens = jnp.zeros((1, t), jnp.int32)
  params = prog.init(jax.random.key(config.seed), init_tokens)
  opt_state = optimizer.init(params)
  logging.info("Model: mixer %s, %d parameters, KDA backend %s.",
               config.model.mixer, model_lib.count_params(params),
               kda_backend(config))

  ckpt = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start = 0
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path) and ckpt.latest_step() is not None:
    with open(summary_path) as f:
      previous = json.load(f)
    if previous.get("steps") == ckpt.latest_step():
      ckpt.close()
      logging.info("%s already finished (%d steps); nothing to do.", workdir,
                   previous["steps"])
      return previous
  if ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    restored = ckpt.restore(start, args=ocp.args.StandardRestore(
        dict(params=params, opt_state=opt_state)))
    params, opt_state = restored["params"], restored["opt_state"]
    logging.info("Resumed from the checkpoint at step %d in %s.", start,
                 workdir)
  log = MetricsLog(workdir, start)

  last = tr.num_steps if stop_at_step is None else min(stop_at_step,
                                                       tr.num_steps)
  if start == 0:
    loss, acc = evaluate(params)
    log.write(dict(step=0, split="eval", loss=loss, accuracy=acc))

  t0 = time.time()
  window_t, window_steps = t0, 0
  for step in range(start, last):
    batch = task.sample(tasks_lib.rng(config.seed, tasks_lib.TRAIN_STREAM,
                                      step), b).as_dict()
    params, opt_state, m = train_step(params, opt_state, batch)
    m = jax.device_get(m)
    if not m.pop("grads_finite"):
      raise FloatingPointError(f"Non-finite gradients at step {step + 1}.")
    chex.assert_tree_all_finite(m)
    done = step + 1
    window_steps += 1
    if done % tr.log_every == 0 or done == last:
      now = time.time()
      sps = window_steps / max(now - window_t, 1e-9)
      window_t, window_steps = now, 0
      log.write(dict(step=done, split="train", loss=float(m["loss"]),
                     accuracy=float(m["accuracy"]),
                     grad_norm=float(m["grad_norm"]),
                     learning_rate=float(schedule(step)),
                     steps_per_second=sps, tokens_per_second=sps * b * t))
      logging.info(
          "step %d/%d  loss %.4f  acc %.4f  %.2f steps/s  %.0f tokens/s  "
          "ETA %.0f s", done, tr.num_steps, m["loss"], m["accuracy"], sps,
          sps * b * t, (tr.num_steps - done) / max(sps, 1e-9))
    solved = False
    if done % tr.eval_every == 0 or done == tr.num_steps:
      loss, acc = evaluate(params)
      log.write(dict(step=done, split="eval", loss=loss, accuracy=acc))
      logging.info("step %d  held-out loss %.4f  accuracy %.4f", done, loss,
                   acc)
      solved = (tr.stop_at_accuracy is not None
                and acc >= tr.stop_at_accuracy)
    if done % tr.checkpoint_every == 0 or done == tr.num_steps or solved:
      ckpt.save(done, args=ocp.args.StandardSave(
          dict(params=params, opt_state=opt_state)))
    if solved:
      logging.info("Held-out accuracy %.4f >= train.stop_at_accuracy %.4f at"
                   " step %d: stopping.", acc, tr.stop_at_accuracy, done)
      last = done
      break
  ckpt.wait_until_finished()
  ckpt.close()
  wall = time.time() - t0
  trained = last - start

  evals = log.evals()
  summary = dict(
      task=task.name, mixer=config.model.mixer, backend=kda_backend(config),
      seed=config.seed, steps=last,
      final_eval_accuracy=evals[-1]["accuracy"] if evals else None,
      best_eval_accuracy=max((r["accuracy"] for r in evals), default=None),
      chance_accuracy=task.chance_accuracy,
      steps_to_99=steps_to_accuracy(evals),
      learning_rate=tr.learning_rate, batch_size=b, seq_len=t,
      mesh=[config.mesh.data, config.mesh.context],
      num_params=model_lib.count_params(params),
      wall_seconds=wall, steps_per_second=trained / wall if trained else None,
      steps_trained_this_run=trained)
  log.close()
  if stop_at_step is not None and last == stop_at_step < tr.num_steps:
    logging.info("Stopped at step %d of %d (stop_at_step).", last,
                 tr.num_steps)
    return summary
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
  plotting.plot_accuracy(
      {config.model.mixer: ([r["step"] for r in evals],
                            [r["accuracy"] for r in evals])},
      chance=task.chance_accuracy, path=os.path.join(workdir, "accuracy.png"),
      title=f"{task.name}: {config.model.mixer} (seed {config.seed})")
  logging.info("Done: %s", json.dumps(summary))
  return summary
