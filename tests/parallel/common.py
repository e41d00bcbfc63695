"""Shared pieces of the context-parallel tests: meshes and packed segment ids.

The tests run on 8 simulated CPU devices (tests/conftest.py). The shard_maps
keep `jax.shard_map`'s default `check_vma=True` (vma type checking), as a
user's would; the Mosaic CP test (tokamax's own CP kernel in interpret mode)
keeps `check_vma=False`.
"""

import jax
import numpy as np

from tests import devices as test_devices

T = 64  # shards of 32, 16 and 8 tokens for 2, 4 and 8 ranks


def mesh(num_ranks, names=("context",), shape=None):
  devices = np.array(test_devices.devices(int(np.prod(shape
                                                        or (num_ranks,)))))
  return jax.sharding.Mesh(devices.reshape(shape or (num_ranks,)), names)


def packed_segment_ids():
  """[2, 64] ids: documents across rank boundaries, a boundary exactly at a
  split (32, a split for 2, 4 and 8 ranks), a reappearing id (a new run of
  segment 2 after segment 3), padding inside a run, a whole 8-token shard of
  padding inside a document (rank 5 of 8) and trailing padding (the whole
  last shard for 8 ranks in row 1).
  """
  row0 = [1] * 20 + [2] * 12 + [3] * 14 + [2] * 13 + [0] * 5
  row1 = [1] * 10 + [0] * 3 + [1] * 11 + [2] * 16 + [0] * 8 + [2] * 4 + [
      0] * 12
  ids = np.array([row0, row1], np.int32)
  assert ids.shape == (2, T)
  return ids
