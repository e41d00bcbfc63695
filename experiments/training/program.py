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
the processes up (`experiments.training.distributed`).
"""

import collections
import copy
import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from configs import validation as config_checks
from experiments import tasks as tasks_lib
from experiments.training import distributed
from experiments.training import metrics as metrics_lib
from experiments.training import model as model_lib
from linear_attention.modules import registry
from linear_attention.ops.kda import api as kda_api
from linear_attention.parallel import train as parallel_train



def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field of `config`.

  The field checks (`configs.validation`), then what needs the code: each
  layer's mixer checks its own section, a context mesh needs mixers that
  run with T split over it (NotImplementedError otherwise), and the task is
  built (its own checks), so a run refuses a bad config before it writes
  anything.
  """
  config_checks.validate_config(config, config_checks.Vocabulary(
      mixers=registry.names(), status_rules=metrics_lib.STATUS_RULES,
      stream_tasks=tuple(name for name, task in tasks_lib.TASKS.items()
                         if callable(getattr(task, "cut", None)))))
  model_lib.validate_mixer_sections(config.model)
  if config.mesh.context > 1:
    _check_context_parallel(config.model)
  task = tasks_lib.make_task(**config.task.to_dict())  # the task's own checks
  # Before any mesh is made (`make_mesh` compares the mesh with the host's
  # devices): a config's own mistake is named on any host.
  _check_seq_len_splits(task, config.mesh.context)


def with_canonical_names(config: ml_collections.ConfigDict
                         ) -> ml_collections.ConfigDict:
  """`config` with every op backend under its canonical name (the alias
  "mosaic" becomes "tokamax"; "auto" stays): what a run records."""
  sections = model_lib.sections_with(config.model, "op_backend")
  names = {s: kda_api.BACKENDS.parse(config.model[s].backend)
           for s in sections}
  if all(config.model[s].backend == n for s, n in names.items()):
    return config
  config = copy.deepcopy(config)  # keeps the lock
  for section, name in names.items():
    config.model[section].backend = name
  return config


def _check_context_parallel(model) -> None:
  """Every layer's mixer runs with T split over the context axis, which the
  mesh sets (NotImplementedError / ValueError)."""
  for entry in model_lib.layer_entries(model):
    if entry is not None and not entry.capabilities.context_parallel:
      raise NotImplementedError(
          f"model.mixer={model.mixer!r} has a layer of mixer {entry.name!r},"
          " which has no context parallelism; use mesh.context=1 for it.")
  for section in model_lib.sections_with(model, "context_parallel"):
    if model[section].context_axis is not None:
      raise ValueError(
          f"model.{section}.context_axis must be None: mesh.context sets it;"
          f" got {model[section].context_axis!r}.")


def _check_seq_len_splits(task, context: int) -> None:
  """ValueError unless the task's sequences split evenly over `context`
  ranks (mesh.context)."""
  config_checks.check("task.seq_len", task.seq_len % context == 0,
                      f"a multiple of mesh.context ({context})",
                      task.seq_len)


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


SCHEDULES = config_checks.SCHEDULES
decay_start = config_checks.decay_start  # the step a "wsd" decay starts


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
  _check_seq_len_splits(task, config.mesh.context)
  mesh = make_mesh(config)
  model_config = config.model
  if config.mesh.context > 1:
    # The mixers (KDA: its op and its convs) split T across ranks.
    model_config = copy.deepcopy(config.model)
    for section in model_lib.sections_with(config.model, "context_parallel"):
      model_config[section].context_axis = "context"
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
  return parallel_train.shard_loss_fn(
      sums_fn, mesh, "data", "context" if config.mesh.context > 1 else None,
      has_aux=True, check_vma=model_lib.traces_under_check_vma(config.model))


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
