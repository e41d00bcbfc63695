"""What several processes (`jax.distributed.initialize`) agree on, and when.

`line_up` is a barrier of the coordination service; `lined_up` wraps a
jitted step so that each new input signature compiles ahead and the
processes line up before running it: a process that compiled faster would
otherwise wait inside the step's first collective, whose rendezvous (gloo's
on CPU) gives up after 30 seconds. In one process both are no-ops.
"""

import collections

from absl import logging
import jax
import numpy as np
from orbax.checkpoint import multihost

# How long a process waits at a line-up for the others (compiling a large
# step on a loaded host takes minutes; a process that died fails the barrier
# through the coordination service's heartbeat well before this).
LINE_UP_TIMEOUT_S = 3600
_line_ups = collections.Counter()


def line_up(name: str) -> None:
  """Waits until every process reaches this point (no-op in one process).

  A barrier of `jax.distributed`'s coordination service (through orbax's
  `get_barrier_sync_fn`), not a collective: it has its own timeout,
  `LINE_UP_TIMEOUT_S`. Every process must call it with the same names in
  the same order; the n-th call with a name is its own barrier.
  """
  if jax.process_count() == 1:
    return
  _line_ups[name] += 1
  key = f"{name}/{_line_ups[name]}"
  logging.info("Waiting for all %d processes at %s.", jax.process_count(),
               key)
  multihost.get_barrier_sync_fn()(key=key, timeout_ms=LINE_UP_TIMEOUT_S * 1000)


class _LinedUp:
  """A jitted function that, across processes, compiles before it runs.

  On each new input signature (shapes, dtypes, shardings) it compiles
  ahead (`lower(...).compile()`), lines the processes up, and then runs the
  compiled step; traced calls (inside another jit or `eval_shape`) go to
  the jitted function.
  """

  def __init__(self, name: str, fn):
    self.name, self.fn, self.compiled = name, fn, {}

  def __call__(self, *args):
    leaves, treedef = jax.tree.flatten(args)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return self.fn(*args)
    signature = (treedef, tuple((np.shape(x), x.dtype,
                                 getattr(x, "sharding", None))
                                for x in leaves))
    if signature not in self.compiled:
      self.compiled[signature] = self.fn.lower(*args).compile()
      line_up(f"compiled {self.name}")
    return self.compiled[signature](*args)


def lined_up(name: str, fn):
  """`fn` compiled ahead and lined up across processes; `fn` in one."""
  return _LinedUp(name, fn) if jax.process_count() > 1 else fn
