"""Faults: a run killed at any instant, or with a damaged checkpoint, resumes
to the uninterrupted run's metrics, summary and parameters."""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import checkpoints
from experiments.training import metrics as metrics_lib
from experiments.training import train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# The smoke model with a step of a few ms, so a kill lands anywhere: in a
# step, a metrics append, a checkpoint write, the summary.
OVERRIDES = {"model.mixer": "kda", "train.num_steps": 40,
             "train.checkpoint_every": 3, "train.eval_every": 4,
             "train.stop_at_accuracy": 1.0}
DETERMINISTIC = ("task", "mixer", "seed", "steps", "final_eval_accuracy",
                 "best_eval_accuracy", "status", "num_params")


def _config():
  return config_lib.apply_diff(mqar.get_config("smoke"), OVERRIDES)


def _command(workdir):
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  # `--compilation_cache_dir=`: nothing under ~/.cache; the environment
  # names the test's cache (a cached program is the compiled one, bit for
  # bit).
  return [sys.executable, os.path.join(REPO, "run_experiment.py"),
          "--config=configs/mqar.py:smoke", f"--workdir={workdir}",
          "--compilation_cache_dir=", *flags]


def _params(workdir):
  config = _config()
  prog = train.build_program(config)
  params = prog.init(jax.random.key(0), np.zeros((1, 8), np.int32))
  ckpt = checkpoints.manager(workdir)
  step = ckpt.latest_step()
  params, _ = checkpoints.restore(ckpt, step, params, prog.init_opt(params))
  ckpt.close()
  return step, params


def _scores(workdir):
  records = metrics_lib.read_records(os.path.join(workdir, "metrics.jsonl"))
  return [(r["step"], r["split"], r["loss"], r["accuracy"]) for r in records]


def _lines(path):
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for _ in f)


def _kill_at_record(proc, path, count, rng, timeout=120.0):
  """SIGKILL 0-5 ms after `path` holds `count` records.

  Progress, not the clock, picks the moment: on a machine (or with a warm
  cache) where start-up and the whole run take under a second, the kill
  still lands mid-run.
  """
  end = time.time() + timeout
  while time.time() < end and proc.poll() is None:
    if _lines(path) >= count:
      time.sleep(rng.uniform(0.0, 0.005))
      proc.send_signal(signal.SIGKILL)
      return
    time.sleep(0.001)


def _temporary_checkpoints(workdir):
  """{path: mtime} of orbax's half-written checkpoint folders."""
  found = {}
  for path in glob.glob(os.path.join(workdir, "checkpoints",
                                     "*.orbax-checkpoint-tmp*")):
    try:
      found[path] = os.stat(path).st_mtime_ns
    except FileNotFoundError:  # finished (renamed) between glob and stat
      pass
  return found


def _kill_while_checkpointing(proc, workdir, timeout=120.0):
  """SIGKILL as soon as orbax has a checkpoint half written.

  Only a folder this attempt created or touched counts: one left by an
  earlier killed attempt would fire before this one had started.
  """
  before = _temporary_checkpoints(workdir)
  end = time.time() + timeout
  while time.time() < end and proc.poll() is None:
    now = _temporary_checkpoints(workdir)
    if any(before.get(path) != mtime for path, mtime in now.items()):
      proc.send_signal(signal.SIGKILL)
      return
    time.sleep(0.001)


@pytest.mark.slow
def test_sigkill_at_random_moments_resumes_to_the_uninterrupted_run(
    tmp_path):
  # The attempts share a compilation cache of their own, not the suite's
  # (tests/conftest.py): a kill while a program is written may leave a cut
  # entry, which a later attempt reads as a miss (a warning) and compiles.
  # They run on the host's CPU (one process at a time holds a TPU), and so
  # does the uninterrupted run they are compared with exactly: run by the
  # same command, not in this process, whose default device may be a TPU.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
  straight = str(tmp_path / "straight")
  with open(tmp_path / "straight.log", "w") as log:
    done = subprocess.run(_command(straight), cwd=REPO, env=env, stdout=log,
                          stderr=subprocess.STDOUT, timeout=300, check=False)
  assert done.returncode == 0, (tmp_path / "straight.log").read_text()[-3000:]
  with open(os.path.join(straight, "summary.json")) as f:
    reference = json.load(f)
  workdir = str(tmp_path / "killed")
  path = os.path.join(workdir, "metrics.jsonl")
  total = len(_scores(straight))
  rng = random.Random(0)
  kills = 0
  for attempt in range(12):
    logged = _lines(path)  # the next attempt may drop some (resume)
    log = open(tmp_path / f"attempt{attempt}.log", "w")
    proc = subprocess.Popen(_command(workdir), cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    if attempt < 6:
      if attempt % 2:
        _kill_while_checkpointing(proc, workdir)
      else:  # a few records on: in a step, an append, a checkpoint write
        _kill_at_record(proc, path, min(logged + rng.randint(1, 4),
                                        total - 1), rng)
    proc.wait(timeout=300)
    log.close()
    # Both kinds of kill wait for this attempt's own progress (a new record,
    # a checkpoint it writes), so none lands during start-up.
    kills += proc.returncode == -signal.SIGKILL
    if proc.returncode == 0:
      break
  assert proc.returncode == 0, (tmp_path / f"attempt{attempt}.log"
                                ).read_text()[-3000:]
  assert kills >= 3, "too few of the kills landed before the run finished"
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  # exact (here and below): the same compiled steps (the same HLO, on this
  # machine) on the checkpoints' bits and the same batches as the
  # uninterrupted run; resuming repeats the computation, it is no other one.
  assert {k: summary[k] for k in DETERMINISTIC} == {
      k: reference[k] for k in DETERMINISTIC}
  steps = [(r[0], r[1]) for r in _scores(workdir)]
  assert len(steps) == len(set(steps)), "a step logged twice"
  assert _scores(workdir) == _scores(straight)
  (step_a, params_a), (step_b, params_b) = _params(straight), _params(workdir)
  assert step_a == step_b == OVERRIDES["train.num_steps"]
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path):
  config = config_lib.apply_diff(_config(), {"train.num_steps": 12})
  straight = str(tmp_path / "straight")
  train.train_and_evaluate(config, straight)
  workdir = str(tmp_path / "damaged")
  train.train_and_evaluate(config, workdir, stop_at_step=10)  # ckpts 6, 9
  data = glob.glob(os.path.join(workdir, "checkpoints", "9", "**", "d", "*"),
                   recursive=True)
  biggest = max(data, key=os.path.getsize)
  os.truncate(biggest, os.path.getsize(biggest) // 2)
  summary = train.train_and_evaluate(config, workdir)
  assert summary["steps_trained_this_run"] == 12 - 6  # from step 6, not 0
  # exact: resumed, the same compiled steps on the checkpoint's bits.
  assert _scores(workdir) == _scores(straight)
  # With every checkpoint damaged: an error naming the directory.
  train.train_and_evaluate(config, str(tmp_path / "both"), stop_at_step=10)
  for step in ("6", "9"):
    for path in glob.glob(os.path.join(tmp_path, "both", "checkpoints", step,
                                       "**", "_METADATA"), recursive=True):
      os.remove(path)
  with pytest.raises(ValueError, match=r"both/checkpoints: no checkpoint at"
                     r" or before step 9 can be read"):
    train.train_and_evaluate(config, str(tmp_path / "both"))
