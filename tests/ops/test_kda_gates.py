"""The gates' float32 softplus and exp against float64, on whatever device
runs them.

The softplus gate's accuracy decides the op's float32 accuracy on a TPU:
there `jnp.log` / `log1p` are off by up to 1e-4 (v5e, libtpu 0.0.50), and
`jax.nn.softplus` by up to 2.6e-4 relative, which took the op's output to
1.6e-5 of a float64 recurrence; `gates.softplus` measured 5.0e-6 worst on
that chip (the platform's `exp`), 2.4e-7 on a CPU.

The token recurrence's decay exp(g) a token multiplies up: on a TPU v5e
(libtpu 0.0.50.1) float32 `jnp.exp` leans low by 1.35e-6 on average on
[-1e-3, 0] (`benchmarks/elementwise_accuracy.py`), a product of n of them
by about n times that. `gates.exp` uses no platform exp; its bounds below
are what it measures on a CPU and, where they differ, on a TPU v5e, on the
grids of `benchmarks/elementwise_accuracy.py` (which it runs here).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import elementwise_accuracy as ea
from linear_attention import ops
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


ON_TPU = jax.default_backend() == "tpu"


# (name, max ulp on a CPU, on a TPU): measured on a CPU (JAX 0.12.0.1)
# 0.80, 0.50, 0.93 and 0.89 ulp (`jnp.exp` there: 0.89 and 0.50 on the
# first two); on a TPU v5e (libtpu 0.0.50.1) 1.06 and 0.50 ulp on the first
# two grids (`benchmarks/results/elementwise_accuracy_v5e.json`; the chip's
# own `jnp.exp`: 59 and 32 ulp), the last two not yet measured there.
@pytest.mark.parametrize("name, cpu_ulp, tpu_ulp", [
    ("gates_exp", 1.0, 1.1),  # the lower-bound gate's log decays, [-5, 0)
    ("gates_exp_near_zero", 0.75, 0.75),  # decays near one: (0.999, 1]
    ("gates_exp_wide", 1.0, 1.0),  # [-87, 0): down to the smallest normal
    ("gates_exp_positive", 1.0, 1.0),  # [0, 88): exp(a_log), g > 0
])
def test_float32_exp_is_within_an_ulp_of_float64(name, cpu_ulp, tpu_ulp):
  row = ea.measure(name)
  assert row["max_ulp"] <= (tpu_ulp if ON_TPU else cpu_ulp), row


@pytest.mark.parametrize("name", ["gates_exp", "gates_exp_near_zero"])
def test_float32_exp_is_unbiased(name):
  # The mean signed relative error is what a running product of exps adds
  # up. 1e-8: under 1/100 of the TPU v5e's `jnp.exp` (-8.0e-7 on [-5, 0],
  # -1.35e-6 on [-1e-3, 0]); measured on a CPU 7.3e-10 and -1.2e-12, on
  # the v5e 6.5e-10 and -4.3e-13.
  row = ea.measure(name)
  assert abs(row["mean_signed_rel"]) <= 1e-8, row


def test_exp_limits():
  f = jax.jit(gates.exp)
  tiny = np.finfo(np.float32).tiny  # the smallest normal: 2^-126
  low, high = np.float32(gates._EXP_LOW), np.float32(gates._EXP_HIGH)
  below = np.nextafter(low, np.float32(-np.inf))
  above = np.nextafter(high, np.float32(np.inf))
  x = jnp.asarray([0.0, -0.0, -np.inf, np.inf, np.nan, below, -1e30,
                   above, 1e30], jnp.float32)
  np.testing.assert_array_equal(  # exact, NaN where NaN
      f(x), [1.0, 1.0, 0.0, np.inf, np.nan, 0.0, 0.0, np.inf, np.inf])
  # The ends of the range: exp(low) is normal, exp(high) finite, both
  # within 2^-23; one float32 further out the exact result is under 2^-126
  # (0 here) and rounds to float32 inf.
  big = np.float64(np.finfo(np.float32).max)
  assert np.exp(np.float64(below)) < tiny <= np.exp(np.float64(low))
  assert np.exp(np.float64(above)) > big * (1 + 2 ** -24)
  ends = np.asarray(f(jnp.asarray([low, high], jnp.float32)), np.float64)
  want = np.exp(np.asarray([low, high], np.float64))
  np.testing.assert_allclose(ends, want, rtol=2 ** -23)
  assert ends[0] >= tiny and np.isfinite(ends[1])


def test_exp_float64_and_derivative():
  x = np.linspace(-20.0, 20.0, 4001)
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    got = gates.exp(jnp.asarray(x, jnp.float64))
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, np.exp(x), rtol=1e-15)
  x = x.astype(np.float32)
  grad = jax.jit(jax.vmap(jax.grad(gates.exp)))(jnp.asarray(x))
  # exp(x) dx by gates.exp itself: 7.4e-8 off float64 on a CPU.
  np.testing.assert_allclose(np.asarray(grad, np.float64),
                             np.exp(x.astype(np.float64)), rtol=2.4e-7)


def platform_exps(f, *args):
  """The exponentials in f's lowered program (StableHLO `exponential`,
  `exponential_minus_one`): what would reach the platform's exp."""
  return re.findall(r"stablehlo\.exponential\w*",
                    jax.jit(f).lower(*args).as_text())


def test_no_platform_exp_in_exp_softplus_or_the_recurrence():
  x = jnp.zeros(3, jnp.float32)
  assert platform_exps(jnp.exp, x)  # what the check finds
  assert not platform_exps(gates.exp, x)
  assert not platform_exps(jax.grad(lambda x: gates.exp(x).sum()), x)
  assert not platform_exps(gates.softplus, x)
  assert not platform_exps(lambda x: gates.kda_log_decay(
      x[None, None, None], jnp.zeros(1), None, None), x)
  # A layer's decode piece: the op with an initial state and the softplus
  # gate in the kernel, T shorter than a chunk, runs the token recurrence
  # whatever the backend asked for ("chunked" is the layer's default).
  b, t, h, k = 1, 3, 2, 4
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  args = (n(b, t, h, k), n(b, t, h, k), n(b, t, h, k), n(b, t, h, k),
          jnp.full((b, t, h), 0.5, jnp.float32), n(h), n(h * k),
          n(b, h, k, k))

  def decode(q, k, v, g, beta, a_log, dt_bias, state):
    return ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        use_gate_in_kernel=True, use_qk_l2norm=True, initial_state=state,
        output_final_state=True, backend="chunked")[:2]

  assert not platform_exps(decode, *args)
