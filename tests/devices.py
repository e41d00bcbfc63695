"""Devices for multi-device tests, or a skip that names the limit.

`make test` runs on 8 simulated CPU devices (tests/conftest.py); on a single
TPU chip (`make test-tpu`) the default backend has one device, and a test
that needs a mesh of more is skipped with this reason instead of failing.
"""

import jax
import pytest


def devices(n: int) -> list:
  """The first n devices of the default backend; skips the test if fewer."""
  have = jax.devices()
  if len(have) < n:
    pytest.skip(f"needs {n} devices; the default backend has {len(have)}"
                f" ({have[0].device_kind}); multi-device tests run on"
                " simulated CPU devices (make test)")
  return have[:n]
