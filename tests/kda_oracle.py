"""An independent float64 NumPy KDA recurrence, written once for the tests.

Loops over batch, time and head in plain Python/NumPy, straight from
Kimi Linear (arXiv 2510.26692) Eq. 1:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale q_t)
with the op's segment rules (a new run of segment n starts from its initial
state; padding (id 0) is a no-op with zero output). Grouped value heads: v,
g, beta and the states have HV heads, value head j reading q/k head
j // (HV / H).
"""

import numpy as np


def softplus(x):
  return np.logaddexp(0.0, x)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def kda_numpy(q, k, v, g, beta, *, scale=None, a_log=None, dt_bias=None,
              lower_bound=None, use_gate_in_kernel=False, use_qk_l2norm=False,
              initial_state=None, segment_ids=None, max_num_segments=None,
              allow_neg_eigval=False):
  """Returns (o [B,T,HV,V], final [B,HV,K,V] or [B,N,HV,K,V]) in float64.

  allow_neg_eigval only widens the op's accepted beta; the recurrence is the
  same for any beta.
  """
  del allow_neg_eigval
  f = lambda x: None if x is None else np.asarray(x, np.float64)
  q, k, v, g, beta = map(f, (q, k, v, g, beta))
  a_log, dt_bias, initial_state = map(f, (a_log, dt_bias, initial_state))
  b, t, hq, kd = q.shape
  h, vd = v.shape[-2:]  # value heads
  group = h // hq
  scale = kd ** -0.5 if scale is None else scale
  if use_qk_l2norm:
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  if use_gate_in_kernel:
    x = g + (0.0 if dt_bias is None else dt_bias.reshape(h, kd))
    rate = np.exp(a_log)[:, None]
    g = (-rate * softplus(x) if lower_bound is None
         else lower_bound * sigmoid(rate * x))
  segmented = segment_ids is not None
  seg = (np.ones((b, t), np.int64) if not segmented
         else np.asarray(segment_ids, np.int64))
  n = max_num_segments if segmented and max_num_segments else (
      1 if not segmented else int(seg.max(initial=1)))
  if initial_state is None:
    init = np.zeros((b, n, h, kd, vd))
  else:
    init = initial_state if segmented else initial_state[:, None]
  o = np.zeros((b, t, h, vd))
  finals = init.copy()
  for bi in range(b):
    last = 0
    state = np.zeros((h, kd, vd))
    for ti in range(t):
      s_id = seg[bi, ti]
      if s_id == 0:
        continue
      if s_id != last:
        state = init[bi, s_id - 1].copy()
        last = s_id
      for hi in range(h):
        st = np.exp(g[bi, ti, hi])[:, None] * state[hi]
        kt = k[bi, ti, hi // group]
        st = st + beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi] - kt @ st)
        state[hi] = st
        o[bi, ti, hi] = st.T @ (scale * q[bi, ti, hi // group])
      finals[bi, s_id - 1] = state
  return o, (finals if segmented else finals[:, 0])
