"""Two processes on localhost train like one (jax.distributed, CPU + gloo).

Each process is `run_experiment.py` with the distributed flags and two
simulated CPU devices; together they run the MQAR smoke config on a 2 x 2
data x context mesh spanning both. The single-process run of the same
config (in this process, on its simulated devices) is the reference: every
loss and accuracy a two-process run logs must match it (losses to rounding,
accuracies up to near-ties), up to step 3 where the run is killed and after
it resumes from the checkpoint both processes wrote. Each process lines up with the other after compiling each step
(experiments/training/program.py): without it, a loaded machine's compile-time
skew outlasts gloo's 30-second rendezvous.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from configs import common as config_lib
from configs import mqar
from experiments.training import checkpoints
from experiments.training import program as program_lib
from experiments.training import train
from tests import devices as test_devices
from tests.experiments import argmax_ties

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# The `reference` backend compiles fastest; the chunked backend on a mesh is
# the business of tests/parallel and tests/experiments/test_run.py.
CONFIG = ("--config=configs/mqar.py:smoke", "--config.mesh.data=2",
          "--config.mesh.context=2", "--config.model.kda.backend=reference")
TIMEOUT = 600


def _env(devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  env.pop("PYTEST_XDIST_WORKER", None)
  return env


def _free_port():
  """A free TCP port on the loopback, or a skip naming why there is none
  (a sandbox that allows none: the one-chip TPU host of tests/tpu.sh)."""
  try:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      return s.getsockname()[1]
  except OSError as e:
    pytest.skip(f"needs a TCP socket on the loopback for jax.distributed's"
                f" coordinator; this host refuses one ({e})")


def _check_host():
  """Skips unless this process's default backend is the CPU with 4
  devices: the one-process reference runs here on a 2 x 2 mesh, and it is
  compared with the two processes' CPU runs to rounding, so it must run on
  the same platform (a TPU's float32 rounds otherwise); and the processes
  need sockets (`_free_port`)."""
  if jax.default_backend() != "cpu":
    pytest.skip(f"the two processes run on CPU devices (gloo) and are"
                f" compared with this process's run, which must be on the"
                f" CPU too; the default backend is {jax.default_backend()}")
  test_devices.devices(4)
  _free_port()


def _run(args, env, log):
  with open(log, "w") as out:
    return subprocess.Popen([sys.executable, "run_experiment.py",
                             "--compilation_cache_dir=", *args],
                            cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT)


def _wait(procs, logs):
  for p, log in zip(procs, logs):
    try:
      p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    if p.returncode != 0:
      with open(log) as f:
        pytest.fail(f"{log} exited with {p.returncode}:\n{f.read()[-3000:]}")


def _two_processes(workdir, tmp_path, *extra):
  port = _free_port()
  logs = [str(tmp_path / f"p{i}_{len(os.listdir(tmp_path))}.log")
          for i in range(2)]
  procs = [_run([*CONFIG, f"--workdir={workdir}", *extra,
                 f"--coordinator_address=127.0.0.1:{port}",
                 "--num_processes=2", f"--process_id={i}"], _env(2), log)
           for i, log in enumerate(logs)]
  _wait(procs, logs)
  return logs


def _scores(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["split"], r["loss"], r["accuracy"])
            for r in map(json.loads, f)]


def _saved_params(workdir, config, steps):
  """{step: the parameters of the run's checkpoint at that step}."""
  prog = program_lib.build_program(config)
  params = prog.init(jax.random.key(config.seed),
                     jnp.zeros((1, prog.task.seq_len), jnp.int32))
  opt_state = prog.init_opt(params)
  ckpt = checkpoints.manager(workdir)
  try:
    return {step: jax.device_get(
        checkpoints.restore(ckpt, step, params, opt_state)[0])
            for step in steps}
  finally:
    ckpt.close()


def _assert_same(config, actual, expected, saved, trace):
  """Losses to rounding; accuracies the same hits but for positions whose
  top two logits lie within float32 rounding and the runs' drift
  (argmax_ties.py: `saved`, the two-process run's parameters at the steps it
  saved, against `trace`, the one-process run's at every step)."""
  assert [r[:2] for r in actual] == [r[:2] for r in expected]
  for a, e in zip(actual, expected):
    assert a[2] == pytest.approx(e[2], rel=1e-5, abs=1e-6), (a, e)
  argmax_ties.assert_same_run_accuracies(config, actual, expected, saved,
                                         trace)


@pytest.mark.slow
def test_two_processes_match_one_and_resume(tmp_path):
  _check_host()
  config = config_lib.apply_diff(
      mqar.get_config("smoke"), {"mesh.data": 2, "mesh.context": 2,
                                 "model.kda.backend": "reference"})
  single = str(tmp_path / "single")
  train.train_and_evaluate(config, single)
  expected = _scores(single)
  trace, losses = argmax_ties.replay(config)
  # exact: the run's own compiled program, run again on the same data.
  assert losses == [r[2] for r in expected if r[1] == "train"]

  # A two-process run killed after step 3, then resumed from the checkpoint
  # both processes wrote, logs what one process logs in one go.
  killed = str(tmp_path / "killed")
  logs = _two_processes(killed, tmp_path, "--stop_at_step=3")
  for log in logs:  # both compiled each step ahead and lined up before it
    with open(log) as f:
      text = f.read()
    for name in ("init", "init_opt", "eval_step", "train_step"):
      assert f"processes at compiled {name}/1." in text, (name, log)
  assert not os.path.exists(os.path.join(killed, "summary.json"))
  assert max(r[0] for r in _scores(killed)) == 3
  saved = _saved_params(killed, config, [2])  # gone once 4 and 6 are saved
  _assert_same(config, _scores(killed), [r for r in expected if r[0] <= 3],
               saved, trace)
  _two_processes(killed, tmp_path)  # resumes from the step-2 checkpoint
  saved.update(_saved_params(killed, config, [4, 6]))
  _assert_same(config, _scores(killed), expected, saved, trace)
  # Only process 0 writes the run's files. exact: each summary copies its
  # final accuracy from its last eval record, compared above.
  for workdir in (killed, single):
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    final = [r for r in _scores(workdir) if r[1] == "eval"][-1]
    assert summary["final_eval_accuracy"] == final[3]
