"""The chunked form of KDA in plain tensor ops: the bridge to the fast path.

Read this beside `reference.py` (the token recurrence) and `chunked.py` (the
fast form, which computes the same chunk algebra, grouped, blocked and with
closed-form VJPs). One chunk of C tokens at a time (Kimi Linear, arXiv
2510.26692, §3; the WY / UT representation of DeltaNet), per head, with
Gamma the in-chunk cumulative log decay (Gamma_i = g_1 + ... + g_i, per key
channel) and S the state entering the chunk:

    A_kk[i, j] = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd)    (i > j)
    M          = (I + A_kk)^-1 Diag(beta)                            (UT transform)
    W = M (exp(Gamma) * K),   U = M V
    V_new      = U - W S                       (what the chunk writes, net of S)
    A_qk[i, j] = sum_d q_id k_jd exp(Gamma_id - Gamma_jd)            (j <= i)
    O          = (exp(Gamma) * Q) S + A_qk V_new
    S'         = exp(Gamma_C) * S + (exp(Gamma_C - Gamma) * K)^T V_new

Every exp(Gamma_i - Gamma_j) is taken with i >= j, so its argument is <= 0
and it never overflows (the masked entries are set before the exp). The
[C, C, K] decay tensor makes this form O(C^2 K) memory per chunk: it is for
reading and testing, not for speed. Inputs are activated already (g is the
log decay, <= 0) and unnormalised q, k are used as given; no packed segments.
"""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def kda_chunked_naive(q, k, v, g, beta, *, scale, initial_state=None,
                      chunk: int = 64):
  """o [B, T, H, V] and the final state [B, H, K, V], both float32.

  Args:
    q, k, g: [B, T, H, K]; g is the log decay (<= 0).
    v: [B, T, H, V].
    beta: [B, T, H].
    scale: the query scale.
    initial_state: [B, H, K, V] or None (zeros).
    chunk: C, tokens per chunk.
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  f32 = jnp.float32
  n = -(-t // chunk)
  pad = n * chunk - t

  def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]; padding is a no-op
    x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, chunk, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

  qc, kc, vc, gc = chunks(q * scale), chunks(k), chunks(v), chunks(g)
  betac = chunks(beta)  # [N, B, H, C]
  state = (jnp.zeros((b, h, kd, vd), f32) if initial_state is None
           else initial_state.astype(f32))
  i = jnp.arange(chunk)
  below = i[:, None] > i[None, :]  # strictly lower: j < i
  causal = i[:, None] >= i[None, :]
  mm = lambda spec, *xs: jnp.einsum(spec, *xs, precision=_HIGHEST)

  def step(s, xs):
    q, k, v, g, beta = xs  # [B, H, C, K] (v: [.., V]; beta: [B, H, C])
    gamma = jnp.cumsum(g, axis=-2)  # Gamma_i, [B, H, C, K]
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]  # [.., Ci, Cj, K]
    decay_below = jnp.exp(jnp.where(below[..., None], diff, -jnp.inf))
    decay_causal = jnp.exp(jnp.where(causal[..., None], diff, -jnp.inf))
    a_kk = beta[..., :, None] * mm("...ijd,...id,...jd->...ij",
                                   decay_below, k, k)
    eye = jnp.eye(chunk, dtype=f32)
    m = jnp.linalg.solve(eye + a_kk, eye * beta[..., None, :])  # (I+A)^-1 B
    w = mm("...ij,...jd->...id", m, jnp.exp(gamma) * k)
    u = mm("...ij,...jv->...iv", m, v)
    v_new = u - mm("...id,...dv->...iv", w, s)
    a_qk = mm("...ijd,...id,...jd->...ij", decay_causal, q, k)
    o = (mm("...id,...dv->...iv", jnp.exp(gamma) * q, s)
         + mm("...ij,...jv->...iv", a_qk, v_new))
    gamma_end = gamma[..., -1:, :]  # [B, H, 1, K]
    s = (jnp.exp(gamma_end[..., 0, :, None]) * s
         + mm("...jd,...jv->...dv", jnp.exp(gamma_end - gamma) * k, v_new))
    return s, o

  state, o = jax.lax.scan(step, state, (qc, kc, vc, gc, betac))
  o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, V]
  o = jnp.moveaxis(o, 2, 3).reshape(b, n * chunk, h, vd)[:, :t]
  return o, state
