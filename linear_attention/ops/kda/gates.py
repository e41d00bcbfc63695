"""Gate activations and the L2 norm shared by the XLA backends.

Kimi Linear (arXiv 2510.26692, §3-4) uses a per-channel log decay g <= 0:

* default gate:      g = -exp(a_log) * softplus(g_raw + dt_bias)
* lower-bound gate:  g = lower_bound * sigmoid(exp(a_log) * (g_raw + dt_bias)),
  lower_bound in [-5, 0), so that every step decays by at least exp(lower_bound).

tokamax and fla agree on both formulas. All math is in float32 (float64 when
asked for, as the XLA backends do for float64 inputs).
"""

import jax
import jax.numpy as jnp

L2_NORM_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS,
                 dtype=jnp.float32) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in `dtype`."""
  x = jnp.asarray(x, dtype)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


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
    return -rate * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(rate * x)
