"""On the chip: relative error of float32 softplus, exp and log against float64.

Run once on a TPU v5e (2026-12-05, JAX 0.12.0.1, libtpu 0.0.50.1):
    PYTHONPATH=. python docs/probes/transcendentals.py
Output: docs/probes/tpu_v5e_output.txt. Kept as it ran.
"""
import jax, jax.numpy as jnp, numpy as np
from linear_attention.ops.kda import gates
from tests.ops.test_kda_device_accuracy import _inputs
q, k, v, g, beta, a_log, dt_bias = _inputs()
x64 = g.astype(np.float64) + dt_bias.astype(np.float64).reshape(2, 128)
rel = lambda a, b: np.abs(np.asarray(a, np.float64) - b) / np.abs(b)
sp64 = np.logaddexp(0, x64)
x32 = jnp.asarray(x64.astype(np.float32))
print("softplus jax.nn", rel(jax.jit(jax.nn.softplus)(x32), sp64).max(), rel(jax.jit(jax.nn.softplus)(x32), sp64).mean())
print("log1p(exp)", rel(jax.jit(lambda x: jnp.log1p(jnp.exp(x)))(x32), sp64).max())
print("logaddexp", rel(jax.jit(lambda x: jnp.logaddexp(x, 0.))(x32), sp64).max())
print("max(x,0)+log1p(exp(-|x|))", rel(jax.jit(lambda x: jnp.maximum(x, 0.) + jnp.log1p(jnp.exp(-jnp.abs(x))))(x32), sp64).max())
e64 = np.exp(a_log.astype(np.float64))
print("exp(a_log)", rel(jax.jit(jnp.exp)(jnp.asarray(a_log)), e64).max())
y = np.linspace(-60, 0, 100001)
print("exp on [-60,0]", rel(jax.jit(jnp.exp)(jnp.asarray(y, jnp.float32)), np.exp(y.astype(np.float32).astype(np.float64))).max())
z = np.linspace(1e-6, 20, 100001)
print("log on (0,20]", np.abs(np.asarray(jax.jit(jnp.log)(jnp.asarray(z, jnp.float32)), np.float64) - np.log(z.astype(np.float32).astype(np.float64))).max())
print("log1p on [0,1]", rel(jax.jit(jnp.log1p)(jnp.asarray(z[:5000]/20*4, jnp.float32)), np.log1p((z[:5000]/20*4).astype(np.float32).astype(np.float64))).max())
