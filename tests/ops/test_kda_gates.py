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

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import elementwise_accuracy as ea
from linear_attention import ops
from linear_attention.ops.kda import gates

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

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


# (name, max ulp): measured on a CPU (JAX 0.12.0.1) 0.88, 0.50, 0.89 and
# 0.90 ulp (`jnp.exp` there: 0.89 and 0.50 on the first two); with every
# multiply and add rounded on its own, as a TPU v5e does
# (`test_exp_stays_within_an_ulp_when_no_operation_is_fused`), 0.89, 0.50,
# 0.91 and 0.92.
@pytest.mark.parametrize("name, max_ulp", [
    ("gates_exp", 1.0),  # the lower-bound gate's log decays, [-5, 0)
    ("gates_exp_near_zero", 0.75),  # decays near one: (0.999, 1]
    ("gates_exp_wide", 1.0),  # [-87, 0): down to the smallest normal
    ("gates_exp_positive", 1.0),  # [0, 88): exp(a_log), g > 0
])
def test_float32_exp_is_within_an_ulp_of_float64(name, max_ulp):
  row = ea.measure(name)
  assert row["max_ulp"] <= max_ulp, row


_F = np.float32


def _unfused_exp(x, horner_to_one=False):
  """`gates.exp` in NumPy float32, every multiply and add rounded on its
  own (no fused multiply-add), step for step; `horner_to_one`: the
  evaluation before, exp(r) by Horner down to 1/0! (measured on the chip
  at e3a765f)."""
  xc = np.clip(x, _F(gates._EXP_LOW), _F(gates._EXP_HIGH))
  k = np.round(xc * _F(gates._INV_LN2))
  hi = xc - k * _F(gates._LN2_HI)
  lo = k * _F(gates._LN2_LO)
  r = hi - lo
  series = [_F(c) for c in gates._EXP_SERIES]
  if horner_to_one:
    p = np.full_like(r, series[0])
    for c in series[1:] + [_F(1.0), _F(1.0)]:
      p = p * r + c
  else:
    q = np.full_like(r, series[0])
    for c in series[1:]:
      q = q * r + c
    p = _F(1.0) + (hi - (lo - r * r * q))
  pow2 = lambda n: ((n + 127).astype(np.int32) << 23).view(np.float32)
  k = k.astype(np.int32)
  return p * pow2(k >> 1) * pow2(k - (k >> 1))


def test_exp_stays_within_an_ulp_when_no_operation_is_fused():
  # A TPU v5e rounds every float32 multiply and add on its own: NumPy doing
  # so reproduces the chip's measurement of the evaluation before (Horner
  # down to 1/0!) on both grids measured there, to every digit
  # (`benchmarks/results/elementwise_accuracy_v5e.json`: 1.059 and 0.501
  # ulp), where a CPU, fusing, gave 0.80 ulp. Today's evaluation, rounded
  # the same way, stays within an ulp on every grid (0.89, 0.50, 0.91 and
  # 0.92; the earlier one 1.06, 0.50, 1.19 and 1.18).
  with open(os.path.join(REPO, "benchmarks", "results",
                         "elementwise_accuracy_v5e.json")) as fh:
    chip = {r["function"]: r for r in json.load(fh)["functions"]}
  for name in ea.FUNCTIONS:
    if not name.startswith("gates_exp"):
      continue
    _, _, low, high = ea.FUNCTIONS[name]
    x = np.linspace(low, high, 1 << 20, endpoint=False).astype(_F)
    want = np.exp(x.astype(np.float64))
    if name in chip:
      before = ea.ulps(_unfused_exp(x, horner_to_one=True).astype(np.float64),
                       want).max()
      np.testing.assert_allclose(before, chip[name]["max_ulp"], rtol=1e-12)
    now = ea.ulps(_unfused_exp(x).astype(np.float64), want).max()
    assert now <= 0.95, (name, now)


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
