"""Two processes on localhost train like one (jax.distributed, CPU + gloo).

Each process is `run_experiment.py` with the distributed flags and two
simulated CPU devices; together they run the MQAR smoke config on a 2 x 2
data x context mesh spanning both. The single-process run of the same
config (in this process, on its simulated devices) is the reference: every
loss and accuracy a two-process run logs must match it, up to step 3 where
the run is killed and after it resumes from the checkpoint both processes
wrote. Each process lines up with the other after compiling each step
(experiments/program.py): without it, a loaded machine's compile-time skew
outlasts gloo's 30-second rendezvous.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from configs import common as config_lib
from configs import mqar
from experiments import train

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
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(args, env, log):
  with open(log, "w") as out:
    return subprocess.Popen([sys.executable, "run_experiment.py", *args],
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


def _assert_same(actual, expected):
  assert [r[:2] for r in actual] == [r[:2] for r in expected]
  for a, e in zip(actual, expected):
    assert a[2] == pytest.approx(e[2], rel=1e-5, abs=1e-6), (a, e)
    assert a[3] == pytest.approx(e[3], abs=1e-5), (a, e)


@pytest.mark.slow
def test_two_processes_match_one_and_resume(tmp_path):
  single = str(tmp_path / "single")
  train.train_and_evaluate(config_lib.apply_diff(
      mqar.get_config("smoke"), {"mesh.data": 2, "mesh.context": 2,
                                  "model.kda.backend": "reference"}), single)
  expected = _scores(single)

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
  _assert_same(_scores(killed), [r for r in expected if r[0] <= 3])
  _two_processes(killed, tmp_path)  # resumes from the step-2 checkpoint
  _assert_same(_scores(killed), expected)
  # Only process 0 writes the run's files.
  with open(os.path.join(killed, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(single, "summary.json")) as f:
    assert summary["final_eval_accuracy"] == pytest.approx(
        json.load(f)["final_eval_accuracy"], abs=1e-5)
