"""Backend "pallas" (our Pallas TPU kernels) through the public op.

Compiled on a TPU, in Pallas interpret mode elsewhere
(`mosaic.interpreted()`), against the
`reference` backend in float64 (itself anchored by float64 finite
differences): outputs, final states and every gradient (a_log and dt_bias
included) under random cotangents, with grouped value heads, T not a
multiple of the chunk, an initial state and beta in [0, 2]; each limit the
backend names (`NotImplementedError` with its reason; "auto" passes over it);
and the op exported for a TPU v5e with `backend="pallas"` (two Mosaic
kernels in its gradient).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import api
from linear_attention.ops.kda import mosaic
from tests.ops.test_kda import Case, GRAD_ARGS, loss_and_grads, make_inputs

RTOL_F32 = 1e-5
ON_TPU = jax.default_backend() == "tpu"


def kernels():
  """The kernels compiled on a TPU, interpreted anywhere else."""
  return contextlib.nullcontext() if ON_TPU else mosaic.interpreted()


def _float64(args):
  """The inputs in float64 on the host's CPU (a TPU has no float64)."""
  cpu = jax.devices("cpu")[0]
  return {n: jax.device_put(np.asarray(x, np.float64), cpu)
          for n, x in args.items()}


@pytest.mark.parametrize("case", [
    Case(b=1, t=100, h=2, k=128, v=128),  # padded to 128, an initial state
    Case(b=2, t=64, h=1, hv=2, k=128, v=128, beta_max=2.0, init=False),
])
def test_matches_the_float64_reference(case):
  args, kw = make_inputs(case)
  with kernels():
    o, s, grads = loss_and_grads(args, kw, "pallas")
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    o64, s64, grads64 = loss_and_grads(_float64(args), kw, "reference")
  testing.assert_close(o, o64, rtol=RTOL_F32, name="output")
  testing.assert_close(s, s64, rtol=RTOL_F32, name="final_state")
  for name in grads64:
    testing.assert_close(grads[name], grads64[name], rtol=RTOL_F32,
                         name=f"d{name}")


@pytest.mark.parametrize("case, kw, reason", [
    (Case(t=64, k=128, v=128, segments=True), {}, "packed segments"),
    (Case(t=64, k=128, v=128, gate="softplus"), {}, "lower-bound gate"),
    (Case(t=64, k=128, v=128, gate="preactivated"), {}, "lower-bound gate"),
    (Case(t=64, k=64, v=128), {}, "multiples of 128"),
    (Case(t=64, k=128, v=128), dict(output_chunk_states=True),
     "output_chunk_states"),
])
def test_limits_name_themselves(case, kw, reason):
  args, base = make_inputs(case)
  call = lambda backend: ops.kimi_delta_attention(
      **args, backend=backend, **base, **kw)
  with kernels():
    with pytest.raises(NotImplementedError, match=reason):
      call("pallas")
    call("auto")  # "auto" passes over it (here: to chunked)


@pytest.mark.skipif(ON_TPU, reason="the check is for hosts without a TPU")
def test_needs_a_tpu_outside_interpret_mode():
  args, kw = make_inputs(Case(t=64, k=128, v=128))
  with pytest.raises(NotImplementedError, match="needs a TPU"):
    ops.kimi_delta_attention(**args, backend="pallas", **kw)
  assert api.resolved_backend("auto") == "chunked"


def test_op_exports_for_tpu_v5e():
  args, kw = make_inputs(Case(b=1, t=128, h=16, k=128, v=128,
                              dtype="bfloat16"))
  names = [n for n in GRAD_ARGS if n in args]
  specs = [jax.ShapeDtypeStruct(args[n].shape, args[n].dtype) for n in names]

  def loss(*xs):
    full = dict(args, **dict(zip(names, xs)))
    o, s = ops.kimi_delta_attention(**full, output_final_state=True,
                                    backend="pallas", **kw)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  with mosaic.lowering_mode("v5e"):
    exported = jax.export.export(
        jax.jit(jax.grad(loss, argnums=tuple(range(len(names))))),
        platforms=["tpu"])(*specs)
  assert exported.mlir_module().count("tpu_custom_call") == 2
