"""The suite's guard against the memory-map limit (tests/conftest.py).

A process that has compiled many programs holds memory maps for each of them
until JAX's caches let go; past the kernel's limit XLA dies inside its next
compile. The guard drops the caches at half the limit: this checks that doing
so gives the maps back with the JAX installed here.
"""

import jax
import jax.numpy as jnp
import pytest

from tests import conftest


def _chain(x, n):
  for i in range(40):
    x = jnp.sort(jnp.sin(x) @ x, axis=0) + i
  return x * n


# Held for the whole run, as a module's jitted functions are.
_PROGRAM = jax.jit(_chain, static_argnums=1)


def _compile_several():
  """Three programs of 40 sorts and products each (some hundred maps), on
  the CPU (on a TPU host too: the maps are those of XLA's CPU backend)."""
  x = jax.device_put(jnp.ones((16, 16)), jax.devices("cpu")[0])
  for n in range(3):
    _PROGRAM(x, n).block_until_ready()


@pytest.mark.skipif(conftest.memory_maps() is None,
                    reason="this host's /proc does not count memory maps")
def test_dropping_the_caches_gives_the_programs_maps_back():
  _compile_several()  # what a process keeps after its first programs
  conftest.release_programs(limit=1)
  before = conftest.memory_maps()
  _compile_several()
  grown = conftest.memory_maps() - before
  assert grown > 100, grown
  # Under half the limit nothing is dropped.
  assert not conftest.release_programs(limit=10 ** 9)
  assert conftest.memory_maps() - before >= grown - 10
  # Past it the caches go, and the programs' maps with them.
  assert conftest.release_programs(limit=2 * before)
  assert conftest.memory_maps() - before < grown // 4, (
      conftest.memory_maps(), before, grown)
