"""Synthetic tasks that probe a mixer's memory (NumPy, deterministic per seed).

`make_task(name, **kwargs)` builds one by name from the config's `task`
section: `delayed_copy` (copying memory), `mqar` (Zoology's multi-query
associative recall), the Kimi Linear synthetic suite's `palindrome` and
`stack` (arXiv 2510.26692, §5.1), `parity` (state tracking, Grazzi et
al., arXiv 2411.12537), and `text` (byte-level language modelling on the
Python standard library's source).
"""

from experiments.tasks.base import Batch
from experiments.tasks.base import baseline_accuracy
from experiments.tasks.base import EVAL_STREAM
from experiments.tasks.base import held_out
from experiments.tasks.base import rng
from experiments.tasks.base import Task
from experiments.tasks.base import TRAIN_STREAM
from experiments.tasks.delayed_copy import DelayedCopy
from experiments.tasks.mqar import MQAR
from experiments.tasks.palindrome import Palindrome
from experiments.tasks.parity import Parity
from experiments.tasks.stack import Stack
from experiments.tasks.text import Text

TASKS = {"delayed_copy": DelayedCopy, "mqar": MQAR, "palindrome": Palindrome,
         "parity": Parity, "stack": Stack, "text": Text}


def make_task(name: str, **kwargs) -> Task:
  """The task called `name`, built from its keyword fields."""
  if name not in TASKS:
    raise ValueError(f"task.name must be one of {sorted(TASKS)}; got {name!r}.")
  try:
    return TASKS[name](**kwargs)
  except TypeError as e:  # an unknown field
    raise ValueError(f"task {name!r}: {e}") from None


__all__ = ["Batch", "DelayedCopy", "EVAL_STREAM", "MQAR", "Palindrome",
           "Parity", "Stack", "TASKS", "Task", "Text", "TRAIN_STREAM",
           "baseline_accuracy", "held_out", "make_task", "rng"]
