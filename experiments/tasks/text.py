"""Byte-level language modelling on real text: the Python standard library.

The corpus is the `.py` files of the standard library of the interpreter that
runs it (`sysconfig`'s "stdlib" path, without `site-packages`), or of any
directory given as `source_dir` (tests write a small one). Nothing is
downloaded. Files are sorted by relative path; a file is held out when the
SHA-256 of its relative path is 0 mod 50 (about 2%; no file is in both
splits). One token is one byte (vocabulary 256), so the loss in bits per
token is bits per byte.

A batch row is a window of `seq_len` + 1 bytes of the split's files laid end
to end, starting at a uniformly drawn byte (a pure function of (seed,
stream, index), like every task). The window's files are packed documents:
`segment_ids` number them 1, 2, .. along the row, so no layer lets a byte
see another file, and the last byte of each file is not scored (its target
would be the next file's first byte). `cut` shortens a draw's windows to
their last bytes, scoring only the final ones (every evaluation length then
scores the same bytes: `train.eval_score_last`).

The corpus is built once into `cache_dir` (one memory-mapped file of the
bytes and one of the file boundaries per split, in a folder named by the
corpus's SHA-256) and reused by every run on that corpus. By default that is
`CACHE_DIR`, ~/.cache/linear_attention/text_corpus, beside JAX's
compilation cache (`experiments.training.compilation_cache`): outside every
run's workdir, since runs share it (about 31 MB for the standard library); a
relative `cache_dir` is relative to the current folder. `fingerprint()`
(Python version, files, bytes, SHA-256) goes into each run's summary; a run
refuses to resume on another corpus (`experiments.training.train`).
"""

import dataclasses
import functools
import hashlib
import json
import os
import sys
import sysconfig

import numpy as np

from experiments.tasks import base

VOCAB = 256
CACHE_DIR = "~/.cache/linear_attention/text_corpus"  # task.cache_dir default
HELD_OUT_MODULUS = 50  # held out: sha256(relative path) % 50 == 0


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_files(source_dir: str) -> list[str]:
  """Relative paths of the `.py` files under `source_dir`, sorted."""
  out = []
  for root, dirs, files in os.walk(source_dir):
    dirs[:] = sorted(d for d in dirs
                     if d not in ("site-packages", "__pycache__"))
    out.extend(os.path.relpath(os.path.join(root, f), source_dir)
               for f in files if f.endswith(".py"))
  return sorted(out)


def is_held_out(rel_path: str) -> bool:
  digest = hashlib.sha256(rel_path.encode()).digest()
  return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


@functools.lru_cache(maxsize=4)
def load_corpus(source_dir: str, cache_dir: str) -> dict:
  """{"train"/"held_out": (bytes [N] uint8 memmap, ends [F] int64),
  "fingerprint": dict}, built into `cache_dir` on first use."""
  files = list_files(source_dir)
  if not files:
    raise ValueError(f"task.source_dir {source_dir!r} holds no .py files.")
  sha = hashlib.sha256()
  for rel in files:
    sha.update(rel.encode() + b"\0")
    with open(os.path.join(source_dir, rel), "rb") as f:
      sha.update(f.read())
  key = sha.hexdigest()
  root = os.path.join(cache_dir, key[:16])
  meta_path = os.path.join(root, "corpus.json")
  if not os.path.exists(meta_path):
    _build(source_dir, files, root, key)
  with open(meta_path) as f:
    meta = json.load(f)
  out = {"fingerprint": meta["fingerprint"]}
  for split in ("train", "held_out"):
    data = np.memmap(os.path.join(root, f"{split}.bytes"), np.uint8, "r")
    ends = np.load(os.path.join(root, f"{split}.ends.npy"))
    out[split] = (data, ends)
  return out


def _build(source_dir, files, root, key):
  """Writes the two splits, then corpus.json last (a whole cache or none)."""
  os.makedirs(root, exist_ok=True)
  counts = {}
  for split, keep in (("train", False), ("held_out", True)):
    ends, total = [], 0
    tmp = os.path.join(root, f"{split}.bytes.tmp{os.getpid()}")
    with open(tmp, "wb") as out:
      for rel in files:
        if is_held_out(rel) != keep:
          continue
        with open(os.path.join(source_dir, rel), "rb") as f:
          data = f.read()
        if not data:
          continue
        out.write(data)
        total += len(data)
        ends.append(total)
    if not ends:
      raise ValueError(f"the corpus under {source_dir!r} has no {split}"
                       " file (too few files to split).")
    os.replace(tmp, os.path.join(root, f"{split}.bytes"))
    tmp = os.path.join(root, f"{split}.ends.tmp{os.getpid()}.npy")
    np.save(tmp, np.asarray(ends))  # whole, or not there: runs share it
    os.replace(tmp, os.path.join(root, f"{split}.ends.npy"))
    counts[split] = dict(files=len(ends), bytes=total)
  fingerprint = dict(
      python=sys.version.split()[0], files=len(files),
      bytes=sum(c["bytes"] for c in counts.values()), sha256=key,
      splits=counts)
  tmp = os.path.join(root, f"corpus.json.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(dict(fingerprint=fingerprint), f, indent=2)
  os.replace(tmp, os.path.join(root, "corpus.json"))


@dataclasses.dataclass(frozen=True)
class Text:
  """Byte-level language modelling on the standard library's source."""

  seq_len: int
  source_dir: str = ""  # "": this interpreter's standard library
  cache_dir: str = CACHE_DIR  # "~" is the user's home folder
  split: str = "train"  # or "held_out" (`held_out()`: the evaluation's)
  name: str = dataclasses.field(default="text", init=False)

  def __post_init__(self):
    base.check_positive_int("task.seq_len", self.seq_len, 2)
    if not isinstance(self.cache_dir, str) or not self.cache_dir:
      raise ValueError(f"task.cache_dir must be a folder path (default"
                       f" {CACHE_DIR}); got {self.cache_dir!r}.")
    if self.split not in ("train", "held_out"):
      raise ValueError(f"task.split must be 'train' or 'held_out'; got"
                       f" {self.split!r}.")

  def held_out(self) -> "Text":
    """The task the evaluation samples: the held-out files."""
    return dataclasses.replace(self, split="held_out")

  @property
  def vocab_size(self) -> int:
    return VOCAB

  @property
  def chance_accuracy(self) -> float:
    return 1.0 / VOCAB

  def corpus(self) -> dict:
    return load_corpus(os.path.abspath(self.source_dir or stdlib_dir()),
                       os.path.abspath(os.path.expanduser(self.cache_dir)))

  def fingerprint(self) -> dict:
    """What identifies the corpus: Python version, files, bytes, SHA-256."""
    return self.corpus()["fingerprint"]

  def sample(self, rng: np.random.Generator, batch_size: int) -> base.Batch:
    split = self.split
    data, ends = self.corpus()[split]
    t = self.seq_len
    if len(data) < t + 1:
      raise ValueError(f"task.seq_len ({t}) + 1 exceeds the {split} split's"
                       f" {len(data)} bytes.")
    starts = rng.integers(0, len(data) - t, size=batch_size)
    window = np.stack([np.asarray(data[s:s + t + 1]) for s in starts])
    pos = starts[:, None] + np.arange(t + 1)[None, :]
    doc = np.searchsorted(ends, pos, side="right")  # file of each byte
    segment_ids = (doc[:, :t] - doc[:, :1] + 1).astype(np.int32)
    mask = (doc[:, 1:] == doc[:, :t]).astype(np.float32)
    return base.Batch(inputs=window[:, :t].astype(np.int32),
                      targets=window[:, 1:].astype(np.int32), mask=mask,
                      segment_ids=segment_ids)

  def cut(self, batch: base.Batch, length: int,
          score_last: int) -> base.Batch:
    """The windows of `batch` cut to their last `length` positions, scoring
    only the last `score_last` targets.

    Each row is then the window of `length` + 1 bytes that ends at the same
    byte as the original row: the same targets at its end, the
    `length - score_last` positions in front context only (mask 0). Cutting
    the windows of one draw at the longest length to each shorter one scores
    the same bytes at every length (`train.eval_score_last`). The files are
    renumbered from 1 along the cut row; a file's last byte stays unscored.
    """
    t = batch.inputs.shape[1]
    base.check_positive_int("length", length)
    base.check_positive_int("score_last", score_last)
    if not score_last <= length <= t:
      raise ValueError(f"cut needs score_last ({score_last}) <= length"
                       f" ({length}) <= the windows' length ({t}).")
    keep = slice(t - length, t)
    segment_ids = batch.segment_ids[:, keep]
    mask = np.array(batch.mask[:, keep], np.float32)
    mask[:, :length - score_last] = 0.0
    return base.Batch(inputs=batch.inputs[:, keep],
                      targets=batch.targets[:, keep], mask=mask,
                      segment_ids=(segment_ids - segment_ids[:, :1] + 1
                                   ).astype(np.int32))
