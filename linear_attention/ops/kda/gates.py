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
"""

import jax
import jax.numpy as jnp

L2_NORM_EPS = 1e-6


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


@jax.custom_jvp
def softplus(x: jax.Array) -> jax.Array:
  """log(1 + exp(x)): max(x, 0) + log1p(exp(-|x|)), its log1p by series.

  Float64 inputs take `jax.nn.softplus` (exact enough on every platform).
  The derivative is sigmoid(x), as for `jax.nn.softplus`.
  """
  if x.dtype == jnp.float64:
    return jax.nn.softplus(x)
  return jnp.maximum(x, 0.0) + _log1p_unit(jnp.exp(-jnp.abs(x)))


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
  rate = jnp.exp(jnp.asarray(a_log, dtype))[:, None]  # [H, 1]
  if lower_bound is None:
    return -rate * softplus(x)
  return lower_bound * jax.nn.sigmoid(rate * x)
