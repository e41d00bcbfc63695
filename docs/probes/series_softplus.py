"""On the chip: a softplus without the platform's log, and the op's error with it.

`sp_acc` is the form linear_attention/ops/kda/gates.py now uses (the same
series). Run once on a TPU v5e (2026-12-05, JAX 0.12.0.1, libtpu 0.0.50.1):
    PYTHONPATH=. python docs/probes/series_softplus.py
Output: docs/probes/tpu_v5e_output.txt. Kept as it ran.
"""
import jax, jax.numpy as jnp, numpy as np
from linear_attention import ops, testing
from tests.kda_oracle import kda_numpy
from tests.ops.test_kda_device_accuracy import _inputs
def log1p01(u):  # u in [0, 1]: 2 atanh(u / (2 + u)) by its series
  s = u / (2.0 + u); s2 = s * s; p = 1.0 / 15
  for c in (13, 11, 9, 7, 5, 3, 1): p = p * s2 + 1.0 / c
  return 2.0 * s * p
def sp_acc(x): return jnp.maximum(x, 0.0) + log1p01(jnp.exp(-jnp.abs(x)))
def exp_acc(x):
  n = jnp.round(x * 1.4426950408889634)
  r = (x - n * 0.693145751953125) - n * 1.428606765330187e-06
  p = 1.0 / 5040
  for c in (720, 120, 24, 6, 2, 1, 1): p = p * r + 1.0 / c
  return p * jnp.exp2(n)
def sp_acc2(x): return jnp.maximum(x, 0.0) + log1p01(exp_acc(-jnp.abs(x)))
q, k, v, g, beta, a_log, dt_bias = args = _inputs()
x64 = g.astype(np.float64) + dt_bias.astype(np.float64).reshape(2, 128)
sp64 = np.logaddexp(0, x64); x32 = jnp.asarray(x64.astype(np.float32))
rel = lambda a, b: np.abs(np.asarray(a, np.float64) - b) / np.abs(b)
for name, f in (("jax.nn", jax.nn.softplus), ("acc", sp_acc), ("acc2", sp_acc2)):
  r = rel(jax.jit(f)(x32), np.logaddexp(0, np.asarray(x32, np.float64)))
  print("softplus", name, r.max(), r.mean(), flush=True)
y = np.linspace(-80, 0, 200001).astype(np.float32)
for name, f in (("jnp.exp", jnp.exp), ("exp_acc", exp_acc), ("exp2 of int", lambda x: jnp.exp2(jnp.round(x)))):
  print("exp", name, rel(jax.jit(f)(jnp.asarray(y)), np.exp(y.astype(np.float64))).max(), flush=True)
u = np.linspace(0, 1, 100001).astype(np.float32)[1:]
print("log1p01", rel(jax.jit(log1p01)(jnp.asarray(u)), np.log1p(u.astype(np.float64))).max())
print("div", rel(jax.jit(lambda u: u / (2.0 + u))(jnp.asarray(u)), u.astype(np.float64) / (2.0 + u.astype(np.float64))).max())
want, _ = kda_numpy(*args[:5], a_log=a_log, dt_bias=dt_bias, lower_bound=None, use_gate_in_kernel=True, use_qk_l2norm=True)
for name, f in (("jax.nn", jax.nn.softplus), ("acc", sp_acc), ("acc2", sp_acc2)):
  gate = jax.jit(lambda x, a: -jnp.exp(a)[:, None] * f(x))(x32, jnp.asarray(a_log))
  for be in ("chunked", "reference"):
    o = jax.jit(lambda *a: ops.kimi_delta_attention(*a, use_qk_l2norm=True, backend=be)[0])(q, k, v, gate, beta)
    print("output", name, be, testing.relative_l2_error(np.asarray(o, np.float64), want), flush=True)
