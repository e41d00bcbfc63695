"""Orbax checkpoints of (params, optimizer state), and quieter orbax logs."""

import gc
import logging as logging_std
import os
import time

from absl import logging
import orbax.checkpoint as ocp

from experiments.training import distributed


class _DropOrbaxInfo(logging_std.Filter):
  """Hides orbax's per-checkpoint INFO chatter (keeps its warnings), and
  asyncio's report of each read orphaned by a failed restore (`_read`: the
  failure is reported once, naming the checkpoint)."""

  def filter(self, record):
    if record.name == "asyncio" and "never retrieved" in record.getMessage():
      return False
    return record.levelno > logging_std.INFO or "orbax" not in record.pathname


SUBDIR = "checkpoints"  # a run directory's checkpoints, one folder a step


def quiet_orbax_logs() -> None:
  """For CLIs: keep the progress log readable (call once, in main)."""
  logging.get_absl_handler().addFilter(_DropOrbaxInfo())


def manager(workdir: str, keep_steps=()) -> ocp.CheckpointManager:
  """The run's checkpoint manager: the last two checkpoints are kept, and
  those of `keep_steps` (a "wsd" run's decay start, to extend it from).

  Across processes, orbax's own barrier here is a collective (gloo's, on CPU,
  gives up after 30 seconds); the processes line up before it.
  """
  distributed.line_up("checkpoint manager")
  policy = ocp.checkpoint_managers.AnyPreservationPolicy([
      ocp.checkpoint_managers.LatestN(2),
      ocp.checkpoint_managers.CustomSteps(list(keep_steps))])
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), SUBDIR),  # orbax: absolute
      options=ocp.CheckpointManagerOptions(preservation_policy=policy,
                                           create=True))


def save(ckpt: ocp.CheckpointManager, step: int, params, opt_state) -> None:
  ckpt.save(step, args=ocp.args.StandardSave(
      dict(params=params, opt_state=opt_state)))


def restore(ckpt: ocp.CheckpointManager, step: int, params, opt_state):
  """(params, opt_state) of `step`, shaped like the given ones."""
  restored = ckpt.restore(step, args=ocp.args.StandardRestore(
      dict(params=params, opt_state=opt_state)))
  return restored["params"], restored["opt_state"]


def has_checkpoint(run_dir: str) -> bool:
  """Whether `run_dir` holds a checkpoint for a run to resume from."""
  if not os.path.isdir(os.path.join(run_dir, SUBDIR)):
    return False
  ckpt = manager(run_dir)
  try:
    return ckpt.latest_step() is not None
  finally:
    ckpt.close()


# How long the reads of a failed restore get to finish (`_read`).
_STRAGGLER_SECONDS = 2.0


def _read(ckpt: ocp.CheckpointManager, step: int, params, opt_state):
  """((params, opt_state), None) of `step`, or (None, why it cannot be read).

  orbax and TensorStore raise many types for one unreadable file. After a
  failed restore orbax closes its event loop while TensorStore's other reads
  of that checkpoint are still in flight, and each reports as it finishes
  ("Event loop is closed", "Future exception was never retrieved"). Here the
  failure is dropped, with the frames that hold those reads, and they get
  time to finish, so that what follows (a fallback, or the error a command
  prints as its last line) comes after that noise.
  """
  try:
    return restore(ckpt, step, params, opt_state), None
  except Exception as e:  # pylint: disable=broad-except
    why = read_error(e)
  time.sleep(_STRAGGLER_SECONDS)
  gc.collect()
  return None, why


def read_error(e: BaseException) -> str:
  """Why a checkpoint did not read, on one line: the innermost cause (orbax
  wraps TensorStore's error, which names the file)."""
  while e.__cause__ is not None:
    e = e.__cause__
  lines = str(e).strip().splitlines() or [type(e).__name__]
  return f"{type(e).__name__}: {lines[0][:300]}"


def latest_params(run_dir: str, params, opt_state):
  """(params, step) of the run's latest checkpoint, shaped like `params`;
  ValueError naming the directory when it has none, or the checkpoint and
  file when it cannot be read (damaged after it was written)."""
  ckpt = manager(run_dir)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise ValueError(f"run {run_dir} has no checkpoint.")
    restored, why = _read(ckpt, step, params, opt_state)
    if restored is None:
      earlier = [s for s in ckpt.all_steps() if s < step]
      remedy = (f"remove {ckpt.directory}/{step} and rerun the run's training"
                f" command with its workdir to resume from step"
                f" {max(earlier)} and retrain the steps after it"
                if earlier else "remove the run directory and retrain it")
      raise ValueError(
          f"checkpoint {step} of {run_dir} cannot be read, a file of it is"
          f" damaged ({why}): {remedy}.")
    params, _ = restored
  finally:
    ckpt.close()
  return params, step


def restore_latest(ckpt: ocp.CheckpointManager, limit: int, params,
                   opt_state):
  """(step, params, opt_state) of the latest readable checkpoint <= `limit`.

  A checkpoint that fails to read (a truncated or missing file: damaged
  after it was written) is logged and the one before it tried (orbax keeps
  two; the caller deletes the later ones); ValueError naming the directory
  and each checkpoint's error when none can be read, rather than a silent
  restart from step 0.
  """
  damaged = []
  for step in sorted((s for s in ckpt.all_steps() if s <= limit),
                     reverse=True):
    restored, why = _read(ckpt, step, params, opt_state)
    if restored is not None:
      return (step, *restored)
    logging.warning("Checkpoint %d in %s cannot be read (%s); trying the one"
                    " before it.", step, ckpt.directory, why)
    damaged.append((step, why))
  found = "; ".join(f"step {s}: {why}" for s, why in damaged)
  raise ValueError(
      f"{ckpt.directory}: no checkpoint at or before step {limit} can be"
      f" read (damaged: {found}); remove the run directory to retrain it.")
