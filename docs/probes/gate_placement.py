"""On the chip: the op's float32 error under the softplus gate, by where the gate is activated.

Run once on a TPU v5e (2026-12-05, JAX 0.12.0.1, libtpu 0.0.50.1), from the
repository root with the chip as the default device:
    PYTHONPATH=. python docs/probes/gate_placement.py
Output: docs/probes/tpu_v5e_output.txt. Kept as it ran; not part of
the test suite (tests/ops/test_kda_gates.py and
tests/ops/test_kda_device_accuracy.py hold the checks).
"""
import jax, jax.numpy as jnp, numpy as np
from linear_attention import ops, testing
from tests.kda_oracle import kda_numpy
from tests.ops.test_kda_device_accuracy import _inputs
args = _inputs()
q, k, v, g, beta, a_log, dt_bias = args
want, _ = kda_numpy(*args[:5], a_log=a_log, dt_bias=dt_bias, lower_bound=None, use_gate_in_kernel=True, use_qk_l2norm=True)
# gate activated on the host in float64
g64 = -np.exp(a_log.astype(np.float64))[:, None] * np.logaddexp(0, g.astype(np.float64) + dt_bias.astype(np.float64).reshape(2, 128))
gact = g64.astype(np.float32)
def err(x): return testing.relative_l2_error(np.asarray(x, np.float64), want)
def run(name, backend, gate_in, dev=None, norm_host=False, **kw):
  qq, kk = q, k
  if norm_host:
    n = lambda x: (x / np.sqrt((x.astype(np.float64)**2).sum(-1, keepdims=True))).astype(np.float32)
    qq, kk = n(q), n(k)
  a = (qq, kk, v, g if gate_in else gact, beta)
  f = lambda *a: ops.kimi_delta_attention(*a, a_log=a_log if gate_in else None, dt_bias=dt_bias if gate_in else None, lower_bound=None, use_gate_in_kernel=gate_in, use_qk_l2norm=not norm_host, backend=backend, **kw)[0]
  if dev is not None:
    a = jax.device_put(a, dev); f = jax.jit(f, device=dev) if False else jax.jit(f)
  try:
    print(f"{name:40s} {err(f(*a)):.3e}", flush=True)
  except Exception as e:
    print(name, "ERR", repr(e)[:300], flush=True)
run("chunked gate-in", "chunked", True)
run("reference gate-in", "reference", True)
run("chunked host gate", "chunked", False)
run("reference host gate", "reference", False)
run("chunked host gate host norm", "chunked", False, norm_host=True)
run("reference host gate host norm", "reference", False, norm_host=True)
with jax.default_matmul_precision("highest"):
  run("chunked gate-in all highest", "chunked", True)
  run("reference gate-in all highest", "reference", True)
cpu = jax.devices("cpu")[0]
with jax.default_device(cpu):
  run("CPU chunked gate-in", "chunked", True)
  run("CPU reference gate-in", "reference", True)
