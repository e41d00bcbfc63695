"""What a config compiles to: validated config, mesh, model, optimiser, steps.

`build_program(config)` checks the config, builds the task, the Haiku model,
AdamW with its schedule, and the jitted train and eval steps (data x context
mesh when `config.mesh` asks for one), and caches the result per config so a
resumed run or a test rerun does not recompile.

Several processes (`jax.distributed.initialize`, one per host): the mesh
spans every device of every process; parameters and optimizer state are
replicated over it (`Program.init`, `Program.init_opt`); every process builds
the same global batch from the (seed, step) stream and places the blocks its
own devices hold (`Program.put_batch`), so a run's data and numbers do not
depend on how many processes run it. The jitted steps compile ahead and line
the processes up (`experiments.distributed`).
"""

import collections
import copy
import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import distributed
from experiments import metrics as metrics_lib
from experiments import model as model_lib
from experiments import tasks as tasks_lib
from linear_attention.ops.kda import api as kda_api
from linear_attention.parallel import train as parallel_train



def _check(name: str, ok: bool, want: str, value: Any) -> None:
  if not ok:
    raise ValueError(f"{name} must be {want}; got {value!r}.")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field of `config`.

  Every field is checked here, the task's and the model's too (by building
  the task and checking the model's arguments), so a run refuses a bad
  config before it writes anything.
  """
  if "task" not in config and {"base", "cells"} <= set(config):
    raise ValueError(
        "the config is a sweep config (a base config crossed with its"
        " cells, configs/sweeps/), not one experiment: give it to the sweep"
        " command, experiments.sweep, or give one experiment config"
        " (configs/*.py).")
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
         isinstance(tr.weight_decay, (int, float)) and tr.weight_decay >= 0
         and math.isfinite(tr.weight_decay), "a finite number >= 0",
         tr.weight_decay)
  for field in ("b1", "b2"):  # Adam's moment decays
    _check(f"train.{field}", isinstance(tr[field], (int, float))
           and 0 <= tr[field] < 1, "in [0, 1)", tr[field])
  _check("train.final_lr_fraction",
         isinstance(tr.final_lr_fraction, (int, float))
         and 0 <= tr.final_lr_fraction <= 1, "in [0, 1]", tr.final_lr_fraction)
  schedule = tr.get("schedule", "cosine")
  _check("train.schedule", schedule in SCHEDULES, f"one of {SCHEDULES}",
         schedule)
  if schedule == "wsd":
    fraction = tr.decay_fraction
    _check("train.decay_fraction", isinstance(fraction, (int, float))
           and 0 < fraction <= 1, "in (0, 1]", fraction)
    _check("train.decay_fraction", decay_start(tr) >= tr.warmup_steps,
           f"small enough that the decay starts after train.warmup_steps"
           f" ({tr.warmup_steps}) of train.num_steps ({tr.num_steps})",
           fraction)
  _check("train.stop_at_accuracy", tr.stop_at_accuracy is None or (
      0 < tr.stop_at_accuracy <= 1), "None or in (0, 1]", tr.stop_at_accuracy)
  _check("train.warmup_steps", tr.warmup_steps < tr.num_steps,
         f"< train.num_steps ({tr.num_steps})", tr.warmup_steps)
  lengths = tr.get("eval_lengths", ())
  _check("train.eval_lengths",
         isinstance(lengths, (tuple, list))
         and all(_is_int(n) and n >= 1 for n in lengths),
         "a tuple of ints >= 1", lengths)
  _check("train.eval_lengths", not lengths or "seq_len" in config.task,
         "empty for a task without a seq_len field", lengths)
  rule = tr.get("status_rule", "accuracy")
  _check("train.status_rule", rule in metrics_lib.STATUS_RULES,
         f"one of {metrics_lib.STATUS_RULES}", rule)
  _check_score_last(config)
  _check("mesh", "mesh" in config, "a section of the config", None)
  for field in ("data", "context"):
    value = config.mesh[field]
    _check(f"mesh.{field}", _is_int(value) and value >= 1, "an int >= 1",
           value)
  _check_curriculum(config)
  for field in ("batch_size", "eval_batch_size"):
    _check(f"train.{field}", tr[field] % config.mesh.data == 0,
           f"a multiple of mesh.data ({config.mesh.data})", tr[field])
  if config.mesh.context > 1:
    if "attention" in model_lib.layer_mixers(config.model):
      raise NotImplementedError(
          f"model.mixer={config.model.mixer!r} has an attention layer, which"
          " has no context parallelism; use mesh.context=1 for it.")
    if model_lib.uses_kda(config.model) and config.model.kda.context_axis is not None:
      raise ValueError(
          "model.kda.context_axis must be None: mesh.context sets it; got"
          f" {config.model.kda.context_axis!r}.")
  task = tasks_lib.make_task(**config.task.to_dict())  # the task's checks
  model_lib.validate_model_config(config.model, task.vocab_size)


def _check_score_last(config) -> None:
  """The checks of `train.eval_score_last` (see configs/common.py)."""
  tr = config.train
  score_last = tr.get("eval_score_last")
  if score_last is None:
    return
  name = "train.eval_score_last"
  task = tasks_lib.TASKS.get(config.task.get("name"))
  _check(name, callable(getattr(task, "cut", None)), "None for a task whose"
         " windows cannot be cut shorter (only a stream task such as text"
         " has `cut`)", score_last)
  shortest = min([config.task.seq_len, *tr.get("eval_lengths", ())])
  _check(name, _is_int(score_last) and 1 <= score_last <= shortest,
         f"None or an int in [1, {shortest}] (task.seq_len and every"
         " train.eval_lengths are at least that long)", score_last)


def _check_curriculum(config) -> None:
  """The checks of `train.length_curriculum` (see configs/common.py)."""
  tr = config.train
  stages = tr.get("length_curriculum", ())
  name = "train.length_curriculum"
  _check(name, isinstance(stages, (tuple, list)) and all(
      isinstance(st, (tuple, list)) and len(st) == 2
      and all(_is_int(n) and n >= 1 for n in st) for st in stages),
         "a tuple of (steps, seq_len) pairs of ints >= 1", stages)
  if not stages:
    return
  _check(name, "seq_len" in config.task, "empty for a task without a seq_len"
         " field", stages)
  total = sum(steps for steps, _ in stages)
  _check(name, total <= tr.num_steps,
         f"stages of at most train.num_steps ({tr.num_steps}) steps in all",
         stages)
  tokens = tr.batch_size * config.task.seq_len
  for _, seq_len in stages:
    _check(name, tokens % seq_len == 0 and (tokens // seq_len)
           % config.mesh.data == 0,
           f"stages whose seq_len divides train.batch_size x task.seq_len"
           f" ({tokens} tokens a step) into a multiple of mesh.data"
           f" ({config.mesh.data}) sequences", stages)
    _check(name, seq_len % config.mesh.context == 0,
           f"stages whose seq_len is a multiple of mesh.context"
           f" ({config.mesh.context})", stages)


def curriculum_shapes(config) -> list[tuple[int, int, int]]:
  """(last step, batch size, seq_len) of each curriculum stage, in order.

  Steps `previous last step + 1 .. last step` (counting from 1) train on
  `batch size` sequences of `seq_len` tokens; steps after the last stage
  train on the task itself. Empty without `train.length_curriculum`.
  """
  tr = config.train
  tokens = tr.batch_size * config.task.get("seq_len", 0)
  out, end = [], 0
  for steps, seq_len in tr.get("length_curriculum", ()):
    end += steps
    out.append((end, tokens // seq_len, seq_len))
  return out


def make_mesh(config) -> jax.sharding.Mesh | None:
  """The ("data", "context") Mesh of `config.mesh`, or None for 1 x 1."""
  data, context = config.mesh.data, config.mesh.context
  n = data * context
  if n == 1:
    if jax.process_count() > 1:
      raise ValueError(
          f"mesh.data * mesh.context must equal the number of devices of all"
          f" {jax.process_count()} processes ({jax.device_count()}) in a"
          f" multi-process run; got 1 x 1.")
    return None
  available = jax.device_count()
  if n > available:
    raise ValueError(
        f"mesh.data * mesh.context ({data} x {context} = {n}) must be <= the"
        f" number of devices ({available}). On CPU, simulate devices with"
        f" XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
  if jax.process_count() > 1 and n != available:
    raise ValueError(
        f"mesh.data * mesh.context ({data} x {context} = {n}) must equal the"
        f" number of devices of all {jax.process_count()} processes"
        f" ({available}) in a multi-process run.")
  devices = np.asarray(jax.devices()[:n]).reshape(data, context)
  return jax.sharding.Mesh(devices, ("data", "context"))


SCHEDULES = ("cosine", "constant", "wsd")


def decay_start(tr) -> int | None:
  """The step at which a "wsd" schedule starts its decay; None otherwise."""
  if tr.get("schedule", "cosine") != "wsd":
    return None
  return tr.num_steps - round(tr.decay_fraction * tr.num_steps)


def make_schedule(tr) -> optax.Schedule:
  """train.schedule: linear warm-up, then cosine, constant or wsd."""
  peak, warmup = tr.learning_rate, tr.warmup_steps
  end = peak * tr.final_lr_fraction
  match tr.get("schedule", "cosine"):
    case "cosine":
      return optax.warmup_cosine_decay_schedule(
          init_value=0.0, peak_value=peak, warmup_steps=warmup,
          decay_steps=tr.num_steps, end_value=end)
    case "constant":
      return optax.warmup_constant_schedule(0.0, peak, warmup)
    case "wsd":
      start = decay_start(tr)
      return optax.join_schedules(
          [optax.linear_schedule(0.0, peak, warmup),
           optax.constant_schedule(peak),
           optax.linear_schedule(peak, end, tr.num_steps - start)],
          boundaries=[warmup, start])
  raise ValueError(f"train.schedule must be one of {SCHEDULES}; got"
                   f" {tr.schedule!r}.")


def make_optimizer(tr) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with `train.schedule` and global-norm clipping."""
  schedule = make_schedule(tr)
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


@dataclasses.dataclass(frozen=True)
class Program:
  """What a config compiles to: task, model, optimiser and jitted steps."""

  task: Any
  model: Any
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  train_step: Any  # (params, opt_state, batch) -> (params, opt_state, metrics)
  eval_step: Any  # (params, batch) -> (loss, accuracy)
  init: Any  # (rng, tokens) -> params (replicated over the mesh)
  init_opt: Any  # params -> optimizer state (replicated over the mesh)
  put_batch: Any  # {name: [B, T] NumPy} -> arrays sharded over the mesh


# Reusing the jitted functions of an identical config (a resumed run, a test
# rerun) skips recompiling; a few entries at most.
_PROGRAMS: "collections.OrderedDict[str, Program]" = collections.OrderedDict()
_MAX_PROGRAMS = 4


def build_program(config) -> Program:
  """Builds (or reuses) the task, model and jitted steps for `config`."""
  key = config.to_json_best_effort(sort_keys=True)
  if key in _PROGRAMS:
    return _PROGRAMS[key]
  task = tasks_lib.make_task(**config.task.to_dict())
  mesh = make_mesh(config)
  model_config = config.model
  context = config.mesh.context
  if context > 1:
    _check("task.seq_len", task.seq_len % context == 0,
           f"a multiple of mesh.context ({context})", task.seq_len)
    if model_lib.uses_kda(config.model):  # KDA and its conv across ranks
      model_config = copy.deepcopy(config.model)
      model_config.kda.context_axis = "context"
  model = model_lib.make_model(model_config, task.vocab_size)
  # Parameters do not depend on the mesh: initialise them outside it.
  init_model = (model if model_config is config.model else
                model_lib.make_model(config.model, task.vocab_size))
  optimizer, schedule = make_optimizer(config.train)
  loss_fn = _loss_fn(config, model, mesh, task.vocab_size)
  shapes = {(config.train.batch_size, task.seq_len)} | {
      (sb, st) for _, sb, st in curriculum_shapes(config)}
  replicated = None
  if mesh is not None:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  prog = Program(
      task=task, model=model, optimizer=optimizer, schedule=schedule,
      train_step=distributed.lined_up(
          "train_step", _train_step(loss_fn, optimizer, shapes)),
      eval_step=distributed.lined_up("eval_step", jax.jit(loss_fn)),
      init=distributed.lined_up("init", jax.jit(init_model.init,
                                                out_shardings=replicated)),
      init_opt=distributed.lined_up("init_opt", jax.jit(
          optimizer.init, out_shardings=replicated)),
      put_batch=_put_batch(mesh))
  _PROGRAMS[key] = prog
  while len(_PROGRAMS) > _MAX_PROGRAMS:
    _PROGRAMS.popitem(last=False)
  return prog


def _loss_fn(config, model, mesh, vocab_size):
  """(params, batch) -> (mean loss, accuracy) over the scored positions."""

  def sums_fn(params, batch):  # on one shard of the mesh, or on everything
    logits = model.apply(params, batch["inputs"], batch.get("segment_ids"))
    chex.assert_shape(logits, (*batch["inputs"].shape, vocab_size))
    return masked_sums(logits, batch["targets"], batch["mask"])

  if mesh is None:
    def loss_fn(params, batch):
      nll, count, correct = sums_fn(params, batch)
      denom = jnp.maximum(count, 1.0)
      return nll / denom, correct / denom
    return loss_fn
  # tokamax's Pallas kernels do not trace under shard_map's check_vma.
  may_run_mosaic = model_lib.uses_kda(config.model) and (
      kda_api.may_run_mosaic(config.model.kda.backend))
  return parallel_train.shard_loss_fn(
      sums_fn, mesh, "data", "context" if config.mesh.context > 1 else None,
      has_aux=True, check_vma=not may_run_mosaic)


def _train_step(loss_fn, optimizer, shapes):
  """The jitted AdamW step; its metrics stay on the device."""

  @jax.jit
  def train_step(params, opt_state, batch):
    chex.assert_equal_shape([batch["inputs"], batch["targets"],
                             batch["mask"]])
    if batch["inputs"].shape not in shapes:
      raise ValueError(f"a training batch must have a shape in {sorted(shapes)}"
                       f" (train.batch_size x task.seq_len, or a stage of"
                       f" train.length_curriculum); got"
                       f" {batch['inputs'].shape}.")
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

  return train_step


def _put_batch(mesh):
  """{name: [B, T] NumPy} -> arrays sharded over `mesh` (as is without)."""
  if mesh is None:
    return lambda batch: batch
  sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data", "context"))

  def put_batch(batch):
    return {name: jax.make_array_from_callback(
        x.shape, sharding, lambda index, x=x: x[index])
            for name, x in batch.items()}

  return put_batch
