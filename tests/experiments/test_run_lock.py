"""Run locks: one trainer per run, across processes and hosts."""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

from experiments.sweeps import run_lock


def _write_lock(run_dir, **owner):
  with open(run_dir + ".lock", "w") as f:
    json.dump(owner, f)


def test_claims_skip_live_owners_and_take_over_dead_ones(tmp_path):
  run_dir = str(tmp_path / "cell" / "run")
  assert run_lock.claim(run_dir)
  assert run_lock.claim(run_dir)  # this process holds it already
  owner = run_lock.read(run_dir + ".lock")
  assert owner["host"] == socket.gethostname() and owner["pid"] == os.getpid()
  assert owner["started"] <= time.time()
  run_lock.release(run_dir)
  assert not os.path.exists(run_dir + ".lock")
  host = socket.gethostname()
  _write_lock(run_dir, host=host, pid=os.getppid(), started=0.0)  # alive
  assert not run_lock.claim(run_dir)
  run_lock.release(run_dir)  # not ours: left alone
  assert os.path.exists(run_dir + ".lock")
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  _write_lock(run_dir, host=host, pid=dead.pid, started=0.0)
  assert run_lock.claim(run_dir)
  assert run_lock.read(run_dir + ".lock")["pid"] == os.getpid()
  assert os.listdir(tmp_path / "cell") == ["run.lock"]  # no tombstones left
  run_lock.release(run_dir)


def test_a_lock_of_another_host_is_taken_over_only_after_its_lease(tmp_path):
  run_dir = str(tmp_path / "run")
  # pid 1 exists here, but on "elsewhere" only the lease says anything.
  _write_lock(run_dir, host="elsewhere", pid=1, started=time.time())
  assert not run_lock.claim(run_dir)
  stale = time.time() - run_lock.LEASE_SECONDS - 5
  os.utime(run_dir + ".lock", (stale, stale))
  assert run_lock.claim(run_dir)
  # The owner's Lease keeps the lock fresh while it trains.
  os.utime(run_dir + ".lock", (stale, stale))
  with run_lock.Lease(run_dir, every=0.05):
    time.sleep(0.3)
  assert time.time() - os.stat(run_dir + ".lock").st_mtime < 5
  assert not run_lock.is_dead(dict(host="elsewhere", mtime=time.time()))


def _race(workdir, runs, log):
  """A worker as run_sweep is: skip done runs, claim, train, mark done."""
  for name in runs:
    run_dir = os.path.join(workdir, name)
    done = os.path.join(run_dir, "done")
    if os.path.exists(done) or not run_lock.claim(run_dir):
      continue
    try:
      if os.path.exists(done):
        continue
      with open(log, "a") as f:
        f.write(f"{name} {os.getpid()}\n")
      time.sleep(0.02)
      os.makedirs(run_dir, exist_ok=True)
      open(done, "w").close()
    finally:
      run_lock.release(run_dir)


def test_racing_workers_train_every_run_exactly_once(tmp_path):
  runs = [f"cell/run{i}" for i in range(24)]
  log = str(tmp_path / "claims.log")
  ctx = multiprocessing.get_context("spawn")
  workers = [ctx.Process(target=_race, args=(str(tmp_path), runs, log))
             for _ in range(8)]
  for w in workers:
    w.start()
  for w in workers:
    w.join(timeout=120)
    assert w.exitcode == 0
  with open(log) as f:
    trained = [line.split()[0] for line in f]
  assert sorted(trained) == sorted(runs)
  assert not [n for n in os.listdir(tmp_path / "cell") if "lock" in n]
