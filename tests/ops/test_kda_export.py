"""backend="tokamax" lowers to Mosaic for a named TPU from any host.

`jax.export` for `platforms=["tpu"]` inside `mosaic.lowering_mode(chip)`:
the exported module must hold tokamax's kernels as `tpu_custom_call`s (the
forward, and the forward and backward kernels of the VJP), with and without
packed segments. Nothing runs; only tracing and lowering.
"""

import os

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import pytest

from experiments.training import interpret
from linear_attention import ops
from linear_attention.ops import backends
from linear_attention.ops.kda import api as kda_api
from linear_attention.ops.kda import mosaic
from tests import devices as test_devices

B, T, H, K = 1, 128, 2, 128


def _op(segments):
  def f(q, k, v, g, beta, a_log, dt_bias, seg):
    o, _ = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm=True,
        segment_ids=seg if segments else None, backend="mosaic")
    return o
  return f


def _args():
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K),
          f32(B, T, H), f32(H), f32(H * K),
          jax.ShapeDtypeStruct((B, T), jnp.int32))


@pytest.mark.parametrize("segments", [False, True])
def test_forward_and_vjp_lower_to_mosaic_for_tpu(segments):
  f = _op(segments)
  grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=range(7))
  with mosaic.lowering_mode("v6e"):
    fwd = jax.export.export(jax.jit(f), platforms=["tpu"])(*_args())
    bwd = jax.export.export(jax.jit(grad), platforms=["tpu"])(*_args())
  assert fwd.platforms == ("tpu",)
  n_fwd = fwd.mlir_module().count("tpu_custom_call")
  n_bwd = bwd.mlir_module().count("tpu_custom_call")
  assert n_fwd >= 1, "no Mosaic kernel in the forward"
  assert n_bwd > n_fwd, "the VJP holds no backward kernel"


def test_outside_the_mode_mosaic_raises_off_tpu_and_chips_parse():
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="lowering_mode"):
      jax.export.export(jax.jit(_op(False)), platforms=["tpu"])(*_args())
  assert mosaic.off_tpu_mode() is None
  with mosaic.lowering_mode("v5p"):
    assert mosaic.off_tpu_mode() == "lowering"
    with interpret.interpret_mode():
      assert mosaic.off_tpu_mode() == "interpret"
    assert mosaic.off_tpu_mode() == "lowering"
  assert mosaic.off_tpu_mode() is None
  assert mosaic.chip_version("v6e").name == "TPU_V6E"
  assert mosaic.chip_version("TPU_7X").name == "TPU_7X"
  with pytest.raises(ValueError, match="chip must be"):
    mosaic.chip_version("v9z")


def test_interpret_mode_restores_what_it_switched():
  # The two process-wide switches are the program's (experiments/), not the
  # library's; both are back as they were after the context, error or not.
  lookup, env = pltpu.get_tpu_info, os.environ.get(interpret.ENV)
  with pytest.raises(RuntimeError, match="inside"):
    with interpret.interpret_mode("v5p"):
      assert os.environ[interpret.ENV] == "1"
      assert pltpu.get_tpu_info().generation == 5
      raise RuntimeError("inside")
  assert pltpu.get_tpu_info is lookup
  assert os.environ.get(interpret.ENV) == env
  assert mosaic.off_tpu_mode() is None


def test_lowering_mode_targets_the_chip_through_jax_not_a_patch():
  # The target is JAX's abstract device; nothing in JAX or tokamax replaced.
  lookup = pltpu.get_tpu_info
  assert kda_api.resolved_backend("auto") == "chunked"  # a CPU host
  mesh = jax.sharding.Mesh(test_devices.devices(4)[:2], ("data",))
  with mosaic.lowering_mode("v6e", mesh) as abstract:
    assert pltpu.get_tpu_info is lookup
    assert pltpu.get_tpu_info().generation == 6  # from the abstract device
    assert abstract.abstract_device.device_kind == "TPU v6 lite"
    assert kda_api.resolved_backend("auto") == "tokamax"
    assert backends.chunk_size() == 64  # the TPU's, not the host's
    assert backends.target_platform() == "tpu"
    assert backends.target_mesh(mesh) is abstract
    other = jax.sharding.Mesh(test_devices.devices(4), ("data",))
    assert backends.target_mesh(other) is other  # another shape: untouched
  with mosaic.lowering_mode("v5p"):
    assert pltpu.get_tpu_info().generation == 5
    assert jax.sharding.get_abstract_mesh().abstract_device.num_cores == 2
    assert kda_api.resolved_backend("auto") == "chunked"  # before v6
  assert backends.target_mesh(mesh) is mesh
  assert backends.target_platform() == jax.default_backend()
  with pytest.raises(ValueError, match="num_cores"):
    mosaic.abstract_tpu("v6e", num_cores=3)
