"""Gate activations and the L2 norm shared by the XLA backends.

Kimi Linear (arXiv 2510.26692, §3-4) uses a per-channel log decay g <= 0:

* default gate:      g = -exp(a_log) * softplus(g_raw + dt_bias)
* lower-bound gate:  g = lower_bound * sigmoid(exp(a_log) * (g_raw + dt_bias)),
  lower_bound in [-5, 0), so that every step decays by at least exp(lower_bound).

tokamax and fla agree on both formulas. All math is in float32 (float64 when
asked for, as the XLA backends do for float64 inputs).

The float32 softplus does not use the platform's `log`: on a TPU v5e
(libtpu 0.0.50) float32 `jnp.log` / `log1p` are off by up to 1e-4 and
`jax.nn.softplus` by up to 2.6e-4 relative (5.8e-5 on average over a
layer's gate inputs), which alone took the op's float32 output from 2.5e-6
to 1.6e-5 of a float64 recurrence under this gate. `softplus` below reads
log1p through its atanh series with only multiplies, adds and one divide
(5.0e-6 worst, 1.3e-6 average on that chip, most of it `exp`'s).

For the same reason float32 `exp` here is not the platform's either. On
that chip (libtpu 0.0.50.1, JAX 0.12.0.1; `benchmarks/elementwise_accuracy.py`,
float64 NumPy as the truth) float32 `jnp.exp` is off by up to 59 ulp on
[-5, 0] and leans low: a mean signed relative error of -8.0e-7 there and
-1.35e-6 on [-1e-3, 0], so a running product of n exps, which is what the
token recurrence and a layer's decode apply to the state, is off by about
n x 1.35e-6 (-8.6e-5 at n = 64, -5.5e-3 at 4096). `exp` below is Cody-Waite
reduction, a degree-7 polynomial and an exact power of two; on a CPU it
measures 0.88 ulp at most and a mean signed relative error of -6.1e-10 on
[-5, 0], 0.50 ulp and -2.9e-14 on [-1e-3, 0] (`jnp.exp` there: 0.89 ulp,
4.7e-10). On the v5e its evaluation before (Horner down to 1/0!) measured
1.06 ulp and 6.5e-10 on [-5, 0] (`gates_exp` in
`benchmarks/results/elementwise_accuracy_v5e.json`); that chip rounds each
multiply and add on its own, and so rounded (NumPy, `tests/ops/
test_kda_gates.py`) today's evaluation stays within 0.92 ulp on every
range. `softplus` and the rate exp(a_log) of `kda_log_decay` use it.
"""

import math

import jax
import jax.numpy as jnp

L2_NORM_EPS = 1e-6

# exp's Cody-Waite split of ln 2 (fdlibm's expf): _LN2_HI = 0x3f317200 ends
# in nine zero bits, so k * _LN2_HI is exact for |k| <= 2^9 (here <= 128).
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06  # ln 2 - _LN2_HI, to float32
_INV_LN2 = 1.4426950408889634
# 1/7!, 1/6!, ..., 1/2!: exp(r) = 1 + r + r^2 q(r) by Taylor to r^7, q by
# Horner. |r| <= ln2 / 2, so the terms left out sum to at most 7.0e-9 of
# exp(r) (0.08 ulp, at r = -ln2 / 2; float64 NumPy).
_EXP_SERIES = tuple(1.0 / math.factorial(n) for n in range(7, 1, -1))
# The float32 range of x with a normal, finite exp(x): 0xc2aeac4f, the
# least float32 >= ln(2^-126) (the smallest normal), and 0x42b17217, the
# largest <= ln(float32 max).
_EXP_LOW = -87.33654
_EXP_HIGH = 88.72283


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS,
                 dtype=jnp.float32) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in `dtype`."""
  x = jnp.asarray(x, dtype)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# 1/15, 1/13, ..., 1/1: log1p(u) = 2 s sum_n s^(2n) / (2n + 1), s = u / (2 + u).
_ATANH_SERIES = tuple(1.0 / c for c in (15, 13, 11, 9, 7, 5, 3, 1))


def _log1p_unit(u: jax.Array) -> jax.Array:
  """log1p(u) for u in [0, 1] in float32 arithmetic alone.

  s = u / (2 + u) <= 1/3, so the first term left out, 2 s^17 / 17, is below
  1.5e-9 of the sum (s^16 / 17): the float32 rounding of the few operations
  decides.
  """
  s = u / (2.0 + u)
  s2 = s * s
  p = jnp.full_like(s, _ATANH_SERIES[0])
  for c in _ATANH_SERIES[1:]:
    p = p * s2 + c
  return 2.0 * s * p


def _pow2(k: jax.Array) -> jax.Array:
  """2.0^k, exactly, for int32 k in [-126, 127]: the float32 bits of it."""
  return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


@jax.custom_jvp
def exp(x: jax.Array) -> jax.Array:
  """e^x in float32 by multiplies, adds and exact powers of two alone.

  Cody-Waite range reduction: k = round(x / ln 2), hi = x - k ln2_hi
  (exact), lo = k ln2_lo, r = hi - lo (|r| <= ln 2 / 2); exp(r) by its
  Taylor polynomial to r^7 as 1 + (hi - (lo - r^2 q(r))), q by Horner: the
  leading 1 + r is added last and r's rounding stays out of it, so every
  rounding before the last two acts on terms of at most r^2 / 2; then
  times 2^k, built from its bits as 2^(k // 2) 2^(k - k // 2) so that k =
  128 stays in range: both products are exact. Within an ulp with or
  without fused multiply-adds: a TPU v5e rounds each float32 multiply and
  add on its own (its results were reproduced to every digit by NumPy
  doing so), where a CPU may fuse them.

  Why: the token recurrence multiplies its state by one exp a token, so a
  bias in exp adds up. On a TPU v5e (libtpu 0.0.50.1, JAX 0.12.0.1,
  `benchmarks/elementwise_accuracy.py`) float32 `jnp.exp` is off by up to 59
  ulp on [-5, 0], with a mean signed relative error of -8.0e-7 there and
  -1.35e-6 on [-1e-3, 0]: a running product of n of them is off by about
  n x 1.35e-6 (-8.6e-5 at 64, -5.5e-3 at 4096). This function, on a CPU
  against NumPy float64 over 2^20 points (`tests/ops/test_kda_gates.py`):
  0.88 ulp at most and a mean signed relative error of -6.1e-10 on
  [-5, 0], 0.50 ulp and -2.9e-14 on [-1e-3, 0], 0.89 ulp on [-87, 0] and
  0.90 ulp on [0, 88]; with every operation rounded on its own, as on the
  v5e, 0.89, 0.50, 0.91 and 0.92 ulp (Horner down to 1/0!, the evaluation
  before: 1.06, 0.50, 1.19 and 1.18; the chip measured its first two).

  Limits: exp(0) = 1 exactly; x below ln(2^-126) = -87.3365 (a result under
  the smallest normal float32: a denormal, which TPUs flush to zero) and
  -inf give 0; x above ln(float32 max) = 88.7228 and inf give inf; NaN gives
  NaN. Callers pass log decays and -|x| (x <= 0) and a_log (either sign).

  Any dtype but float32 takes `jnp.exp` (float64 for the float64 paths).
  The derivative is exp(x) dx, by this function.
  """
  if x.dtype != jnp.float32:
    return jnp.exp(x)
  xc = jnp.clip(x, _EXP_LOW, _EXP_HIGH)
  k = jnp.round(xc * _INV_LN2)
  hi = xc - k * _LN2_HI
  lo = k * _LN2_LO
  r = hi - lo
  q = jnp.full_like(r, _EXP_SERIES[0])
  for c in _EXP_SERIES[1:]:
    q = q * r + c
  p = 1.0 + (hi - (lo - r * r * q))
  k = k.astype(jnp.int32)
  half = k >> 1  # floor(k / 2): both halves in [-63, 64]
  y = p * _pow2(half) * _pow2(k - half)
  y = jnp.where(x < _EXP_LOW, 0.0, y)
  return jnp.where(x > _EXP_HIGH, jnp.inf, y)


@exp.defjvp
def _exp_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = exp(x)
  return y, y * dx


@jax.custom_jvp
def softplus(x: jax.Array) -> jax.Array:
  """log(1 + exp(x)): max(x, 0) + log1p(exp(-|x|)), its log1p by series.

  Float64 inputs take `jax.nn.softplus` (exact enough on every platform).
  The derivative is sigmoid(x), as for `jax.nn.softplus`.
  """
  if x.dtype == jnp.float64:
    return jax.nn.softplus(x)
  return jnp.maximum(x, 0.0) + _log1p_unit(exp(-jnp.abs(x)))


@softplus.defjvp
def _softplus_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  return softplus(x), jax.nn.sigmoid(x) * dx


def kda_log_decay(
    g_raw: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array | None,
    lower_bound: float | None,
    dtype=jnp.float32,
) -> jax.Array:
  """Activates the raw gate [B, T, H, K] into a float32 log decay (<= 0).

  Args:
    g_raw: [B, T, H, K] raw gate (pre-activation).
    a_log: [H] per-head log decay rate.
    dt_bias: [H * K] per-channel bias added before the activation, or None.
    lower_bound: None for the softplus gate, else the lower-bound value.
    dtype: the compute dtype (float32, or float64).

  Returns:
    [B, T, H, K] log decay in `dtype`.
  """
  _, _, h, k = g_raw.shape
  x = jnp.asarray(g_raw, dtype)
  if dt_bias is not None:
    x = x + jnp.asarray(dt_bias, dtype).reshape(h, k)
  rate = exp(jnp.asarray(a_log, dtype))[:, None]  # [H, 1]
  if lower_bound is None:
    return -rate * softplus(x)
  return lower_bound * jax.nn.sigmoid(rate * x)
