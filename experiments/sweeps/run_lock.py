"""Run locks: which process trains a run of a sweep, across processes and hosts.

A run directory `<run>` is claimed by creating `<run>.lock`, a JSON object
`{"host", "pid", "started"}`. The lock is written to a temporary file first
and then hard-linked onto the lock name (`os.link` fails if the name
exists), so a lock is never seen half-written and two claimants never both
succeed. While it trains, the owner refreshes the lock's modification time
every LEASE_SECONDS / 10 (`Lease`), which is the lease a process on another
host goes by.

A lock is taken over only when its owner is provably gone:

* same host: its pid no longer exists;
* another host (a workdir shared over NFS or a cluster filesystem): its
  lease expired, i.e. the lock was not refreshed for LEASE_SECONDS.

A takeover renames the dead lock to a name of its own first (one rename
wins), checks that what it renamed is the lock it judged dead, and only then
creates its own; a live lock renamed by mistake (another claimant replaced
the dead one in between) is put back.
"""

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any

from absl import logging

SUFFIX = ".lock"
# A lock not refreshed for this long belongs to a dead process on another
# host. Long enough for a loaded machine's stalls (a compile holds no
# thread back: the refresh runs in its own thread), short next to a run.
LEASE_SECONDS = 600.0


def _me() -> dict[str, Any]:
  return dict(host=socket.gethostname(), pid=os.getpid())


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def read(path: str) -> dict[str, Any] | None:
  """The lock's owner (with its `mtime`), or None if there is no lock."""
  try:
    with open(path) as f:
      text = f.read()
    mtime = os.stat(path).st_mtime
  except FileNotFoundError:
    return None
  try:
    owner = json.loads(text)
    if not isinstance(owner, dict):
      raise ValueError(text)
  except ValueError:
    owner = {}  # not a lock of this code: judged by its lease alone
  return dict(owner, mtime=mtime)


def is_dead(owner: dict[str, Any], now: float | None = None) -> bool:
  """Whether the lock's owner is provably gone (see the module docstring)."""
  now = time.time() if now is None else now
  if owner.get("host") == socket.gethostname() and "pid" in owner:
    return not _pid_alive(owner["pid"])
  return now - owner["mtime"] > LEASE_SECONDS


def _create(path: str) -> bool:
  """Creates the lock with this process as owner; False if it exists."""
  owner = dict(_me(), started=time.time())
  tmp = f"{path}.{owner['host']}.{owner['pid']}.tmp"
  with open(tmp, "w") as f:
    json.dump(owner, f)
  try:
    os.link(tmp, path)
    return True
  except FileExistsError:
    return False
  finally:
    os.unlink(tmp)


def _take_over(path: str, dead: dict[str, Any]) -> None:
  """Removes the dead lock `dead` from `path`, and nothing else."""
  me = _me()
  tomb = f"{path}.dead.{me['host']}.{me['pid']}"
  try:
    os.rename(path, tomb)
  except FileNotFoundError:
    return  # another claimant removed it first
  moved = read(tomb) or {}
  same = all(moved.get(k) == dead.get(k) for k in ("host", "pid", "started"))
  if not same:  # a live lock replaced the dead one meanwhile: put it back
    with contextlib.suppress(FileExistsError):
      os.link(tomb, path)
  else:
    logging.info("Taking over %s: its owner %s is gone.", path,
                 {k: dead.get(k) for k in ("host", "pid")})
  os.unlink(tomb)


def claim(run_dir: str) -> bool:
  """Creates `run_dir`.lock for this process; False if a live owner has it.

  True also when this process holds it already.
  """
  path = run_dir + SUFFIX
  os.makedirs(os.path.dirname(path), exist_ok=True)
  for _ in range(3):
    if _create(path):
      return True
    owner = read(path)
    if owner is None:
      continue  # released in between
    if {k: owner.get(k) for k in ("host", "pid")} == _me():
      return True
    if not is_dead(owner):
      return False
    _take_over(path, owner)
  return False


def release(run_dir: str) -> None:
  """Removes `run_dir`.lock if this process holds it."""
  path = run_dir + SUFFIX
  owner = read(path)
  if owner is not None and {k: owner.get(k) for k in ("host", "pid")} == _me():
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)


class Lease:
  """Refreshes `run_dir`.lock every `every` seconds while in the context."""

  def __init__(self, run_dir: str, every: float = LEASE_SECONDS / 10):
    self.path = run_dir + SUFFIX
    self.every = every
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._refresh, daemon=True)

  def _refresh(self):
    while not self._stop.wait(self.every):
      with contextlib.suppress(FileNotFoundError):
        os.utime(self.path)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
