"""The metrics log of a run: metrics.jsonl and TensorBoard scalars.

One JSON object per logged step (`split` "train" or "eval"); on resume the
records logged after the restored checkpoint are dropped, so a killed run
ends with the same metrics as an uninterrupted one.
"""

import json
import os
from typing import Any

from absl import logging
import tensorboardX

from experiments import program as program_lib

TARGET_ACCURACY = 0.99  # "solved": steps to this held-out accuracy


class MetricsLog:
  """metrics.jsonl + TensorBoard; on resume drops records after the step."""

  def __init__(self, workdir: str, resume_step: int, *, writer: bool = True):
    """`writer=False` (processes other than 0) keeps records in memory only.

    Every process reads the existing file before any rewrites it (a barrier
    across processes in a multi-process run).
    """
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.writer = writer
    self.records = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        self.records = [json.loads(line) for line in f if line.strip()]
    program_lib.line_up("metrics log read")
    kept = [r for r in self.records if r["step"] <= resume_step]
    if len(kept) != len(self.records):
      logging.info("Dropping %d metric records logged after step %d.",
                   len(self.records) - len(kept), resume_step)
    self.records = kept
    self.tb = None
    if not writer:
      return
    with open(self.path, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    self.tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, record: dict[str, Any]) -> None:
    self.records.append(record)
    if not self.writer:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key not in ("step", "split") and value is not None:
        self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

  def evals(self) -> list[dict[str, Any]]:
    return [r for r in self.records if r["split"] == "eval"]

  def close(self):
    if self.tb is not None:
      self.tb.close()


def steps_to_accuracy(evals, target: float = TARGET_ACCURACY) -> int | None:
  """The first evaluated step whose held-out accuracy is >= target."""
  for r in evals:
    if r["accuracy"] >= target:
      return r["step"]
  return None


