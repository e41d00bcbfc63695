"""Orbax checkpoints of (params, optimizer state), and quieter orbax logs."""

import logging as logging_std
import os

from absl import logging
import orbax.checkpoint as ocp

from experiments import distributed


class _DropOrbaxInfo(logging_std.Filter):
  """Hides orbax's per-checkpoint INFO chatter; keeps its warnings."""

  def filter(self, record):
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


def latest_params(run_dir: str, params, opt_state):
  """(params, step) of the run's latest checkpoint, shaped like `params`;
  ValueError naming the directory when it has none."""
  ckpt = manager(run_dir)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise ValueError(f"run {run_dir} has no checkpoint.")
    params, _ = restore(ckpt, step, params, opt_state)
  finally:
    ckpt.close()
  return params, step


def restore_latest(ckpt: ocp.CheckpointManager, limit: int, params,
                   opt_state):
  """(step, params, opt_state) of the latest readable checkpoint <= `limit`.

  A checkpoint that fails to read (a truncated or missing file: damaged
  after it was written) is logged and the one before it tried (orbax keeps
  two; the caller deletes the later ones); ValueError naming the directory when none can be read,
  rather than a silent restart from step 0.
  """
  damaged = []
  for step in sorted((s for s in ckpt.all_steps() if s <= limit),
                     reverse=True):
    try:
      return (step, *restore(ckpt, step, params, opt_state))
    except Exception as e:  # pylint: disable=broad-except
      # orbax and TensorStore raise many types for one unreadable file.
      logging.warning("Checkpoint %d in %s cannot be read (%s: %s); trying"
                      " the one before it.", step, ckpt.directory,
                      type(e).__name__, str(e).splitlines()[0][:200])
      damaged.append(step)
  raise ValueError(
      f"{ckpt.directory}: no checkpoint at or before step {limit} can be"
      f" read (damaged: {damaged}); remove the run directory to retrain it.")
