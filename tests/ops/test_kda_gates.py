"""The gates' float32 softplus against float64, on whatever device runs it.

The softplus gate's accuracy decides the op's float32 accuracy on a TPU:
there `jnp.log` / `log1p` are off by up to 1e-4 (v5e, libtpu 0.0.50), and
`jax.nn.softplus` by up to 2.6e-4 relative, which took the op's output to
1.6e-5 of a float64 recurrence; `gates.softplus` measured 5.0e-6 worst on
that chip (the platform's `exp`), 2.4e-7 on a CPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.ops.kda import gates

# exp(-80) = 1.8e-35 is still a normal float32 (below it results flush to 0).
X = np.concatenate([np.linspace(-80.0, 80.0, 160_001),
                    np.linspace(-1e-3, 1e-3, 2_001)]).astype(np.float32)


def test_float32_softplus_is_within_1e_5_of_float64():
  got = np.asarray(jax.jit(gates.softplus)(jnp.asarray(X)), np.float64)
  want = np.logaddexp(0.0, X.astype(np.float64))
  # 1e-5: the op's float32 bound is 1e-5 on the output; 2.4e-7 measured on
  # a CPU (4 ulp), 5.0e-6 on a TPU v5e.
  assert np.max(np.abs(got - want) / want) <= 1e-5


def test_the_derivative_is_the_sigmoid():
  grad = jax.jit(jax.vmap(jax.grad(gates.softplus)))(jnp.asarray(X))
  want = 1.0 / (1.0 + np.exp(-X.astype(np.float64)))
  # The platform's logistic: 8.8e-8 off on a CPU; on a TPU v5e up to 1.2e-6
  # (2.5e-6 relative), so the bound is the value's 1e-5, relative.
  np.testing.assert_allclose(np.asarray(grad, np.float64), want, rtol=1e-5,
                             atol=1e-12)


def test_float32_softplus_uses_no_platform_log():
  # The point of gates.softplus: the platform's float32 log is what a TPU
  # gets wrong, so the float32 path must not reach it (jax.nn.softplus
  # does: its jaxpr holds log1p).
  # (The printed jaxpr holds the nested ones: jit, custom_jvp_call.)
  logs = lambda f: set(re.findall(r"\b(log1p|log)\b", str(
      jax.make_jaxpr(f)(jnp.zeros(3, jnp.float32)))))
  assert logs(jax.nn.softplus) == {"log1p"}
  assert not logs(gates.softplus)
  assert not logs(lambda x: gates.kda_log_decay(
      x[None, None, None], jnp.zeros(1), None, None))


def test_the_limits():
  f = jax.jit(gates.softplus)
  big = np.float32(1e30)
  np.testing.assert_array_equal(  # exact: max(x, 0) + log1p(0) and 0 + 0
      f(jnp.asarray([big, -big, np.inf, -np.inf], jnp.float32)),
      [big, 0.0, np.inf, 0.0])
  assert not np.isnan(np.asarray(f(jnp.asarray([np.inf])))).any()
