"""A run's record in its workdir: whether it is finished, and how it resumes.

A workdir resumes only with the config it was started with
(`check_resumable`: ValueError naming the changed fields otherwise); the
backend, the mesh and the logging and checkpoint intervals may change
(`RESUMABLE_FIELDS`), and so may `train.num_steps` under a "constant" or
"wsd" schedule (`EXTENDABLE_SCHEDULES`). `restore` picks the checkpoint a
run continues from; `check_corpus` keeps a text run on its corpus.
"""

import json
import os
from typing import Any

from absl import logging
import jax
import ml_collections

from experiments.training import checkpoints
from experiments.training import metrics as metrics_lib
from experiments.training import program as program_lib


def is_finished(summary: dict[str, Any], config) -> bool:
  """Whether a run with this summary.json needs no more steps of `config`.

  It reached train.stop_at_accuracy, or trained train.num_steps (a run of
  an extendable schedule whose num_steps was raised is not finished).
  """
  target = config.train.stop_at_accuracy
  best = summary.get("best_eval_accuracy")
  return summary["steps"] >= config.train.num_steps or (
      target is not None and best is not None and best >= target)


def finished_summary(workdir: str, ckpt, config) -> dict[str, Any] | None:
  """The summary of a run that already finished in `workdir`, else None."""
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path) or ckpt.latest_step() is None:
    return None
  with open(path) as f:
    previous = json.load(f)
  if previous.get("steps") != ckpt.latest_step():
    return None  # killed while extending: resume from the checkpoint
  return previous if is_finished(previous, config) else None


def stored_config(workdir: str) -> dict[str, Any] | None:
  """The workdir's config.json as a dict; None if it has none."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _resume_step(workdir: str, ckpt, tr, stored) -> int:
  """The checkpoint step a run continues from (0: from the start).

  The latest checkpoint, unless train.num_steps changed a "wsd" schedule:
  then the latest one before either run's decay started (the steps up to
  it ran at the rates of the new schedule); ValueError if there is none.
  """
  latest = ckpt.latest_step() or 0
  if not latest:
    return 0
  if stored is None or stored["train"]["num_steps"] == tr.num_steps:
    limit = latest
  else:
    limit = latest if tr.schedule == "constant" else min(
        program_lib.decay_start(tr),
        program_lib.decay_start(ml_collections.ConfigDict(stored["train"])))
  start = max((s for s in ckpt.all_steps() if s <= limit), default=None)
  if start is None:
    raise ValueError(
        f"train.num_steps: {workdir} has no checkpoint at or before step"
        f" {limit}, where its \"wsd\" decay started, so it cannot be"
        f" extended to {tr.num_steps} steps; use a new workdir.")
  if start > tr.num_steps:
    raise ValueError(
        f"train.num_steps ({tr.num_steps}) must be >= the step of"
        f" {workdir}'s checkpoint ({start}) to resume it.")
  return start


# Fields that may change between a run and its resumption: where and how it
# runs, not what it computes (the backends are the same op; the mesh splits
# the same batch; the text corpus is the same wherever its cache is, which
# corpus.json checks), and how often it logs or saves.
RESUMABLE_FIELDS = ("model.kda.backend", "mesh.data", "mesh.context",
                    "task.cache_dir", "train.log_every",
                    "train.checkpoint_every")


# Fields added to the configs after runs were written without them, with the
# value that reproduces what the code did before (a run directory written
# then resumes, and counts as the same config, only where the new config
# keeps that value).
ADDED_FIELDS = {"train.eval_lengths": (), "train.length_curriculum": (),
                "train.schedule": "cosine", "train.decay_fraction": 0.2,
                "model.attention.rope": True, "model.kda.chunk_size": None,
                "train.eval_score_last": None,
                "train.status_rule": "accuracy", "model.precision": "auto",
                "model.attention.precision": None}

# Schedules whose num_steps may change between a run and its resumption: a
# constant rate does not depend on it, and a "wsd" run resumes from before
# its decay (`_resume_step`). A cosine schedule depends on it at every step.
EXTENDABLE_SCHEDULES = ("constant", "wsd")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, f"{prefix}{key}."))
    return out
  return {prefix[:-1]: tree}


def config_differences(workdir: str,
                       config: ml_collections.ConfigDict) -> list[str]:
  """The fields where `workdir`'s config.json and `config` disagree.

  One "field: stored -> new" line per difference, outside RESUMABLE_FIELDS;
  empty when the workdir has no config.json; `train.num_steps` only counts
  for a schedule outside EXTENDABLE_SCHEDULES. A field of ADDED_FIELDS absent
  from the stored config ran as the code before it did: it differs only
  where the new config sets another value. Any other field only one side
  has is a change of code, not of config (runs record their commit).
  """
  stored = stored_config(workdir)
  if stored is None:
    return []
  stored = _flatten(stored)
  new = _flatten(json.loads(config.to_json_best_effort()))
  defaults = json.loads(json.dumps(ADDED_FIELDS))  # as read back from JSON
  lines = []
  extendable = new.get("train.schedule") in EXTENDABLE_SCHEDULES
  for key in sorted(new):
    if key in RESUMABLE_FIELDS or (key == "train.num_steps" and extendable):
      continue
    if key in stored:
      if stored[key] != new[key]:  # both sides read back from JSON
        lines.append(f"{key}: {stored[key]!r} -> {new[key]!r}")
    elif key in defaults and defaults[key] != new[key]:
      lines.append(f"{key}: absent (ran as {defaults[key]!r}) ->"
                   f" {new[key]!r}")
  return lines


def check_resumable(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Raises ValueError if `workdir` holds a run of a different config.

  Resuming another config's checkpoint (or counting its finished summary as
  this config's) would mix two experiments in one record.
  """
  diff = config_differences(workdir, config)
  if diff:
    # num_steps differs only where the schedule does not extend.
    extended = any(line.startswith("train.num_steps:") for line in diff)
    hint = (f" (a run is extended by raising train.num_steps only under a"
            f" train.schedule in {EXTENDABLE_SCHEDULES}; this one is"
            f" {config.train.schedule!r})" if extended else "")
    raise ValueError(
        f"workdir {workdir} holds a run of a different config ("
        + "; ".join(diff) + f"){hint}: use a new workdir, or remove that run"
        " to retrain it.")


def check_corpus(workdir: str, task) -> None:
  """Records the task's corpus in `corpus.json`; ValueError if the workdir
  holds a run on another corpus (another Python, other files)."""
  if not hasattr(task, "fingerprint"):
    return
  path = os.path.join(workdir, "corpus.json")
  have = task.fingerprint()
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
    if stored != have:
      raise ValueError(
          f"{workdir} holds a run on another corpus ({stored}); this config"
          f" reads {have}. Use a new workdir.")
  elif jax.process_index() == 0:
    metrics_lib.write_atomic(path, json.dumps(have, indent=2))


def restore(workdir, ckpt, tr, stored, params, opt_state):
  """(start step, params, opt_state): from the checkpoint to resume, if any.

  Later checkpoints (a "wsd" run's decay steps before an extension, or
  damaged ones) are deleted: the run rewrites those steps.
  """
  start = _resume_step(workdir, ckpt, tr, stored)
  if start:
    start, params, opt_state = checkpoints.restore_latest(
        ckpt, start, params, opt_state)
    logging.info("Resumed from the checkpoint at step %d in %s.", start,
                 workdir)
  for step in [s for s in ckpt.all_steps() if s > start]:
    ckpt.delete(step)
  return start, params, opt_state
