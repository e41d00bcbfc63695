"""Token-by-token KDA recurrence: the readable oracle.

Kimi Linear (arXiv 2510.26692), Eq. 1, per head with state S in R^{K x V},
alpha_t = exp(g_t) per key channel and beta_t in [0, 1]:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

In the order the code runs it: decay the state, predict v from k, write the
error back with learning rate beta, read with q:

    S'   = Diag(alpha_t) S_{t-1}
    S_t  = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t  = S_t^T q_t

One `lax.scan` over tokens, batched over B and H. Segments (packed documents)
follow `common`'s rules: a new run loads its segment's initial state, padding
is a no-op with zero output. Accumulation is float32.

alpha_t is `gates.exp(g_t)`, not the platform's `jnp.exp`: the state is
multiplied by one exp a token, so a bias in exp adds up over tokens. On a
TPU v5e (libtpu 0.0.50.1, JAX 0.12.0.1; `benchmarks/elementwise_accuracy.py`)
float32 `jnp.exp` has a mean signed relative error of -1.35e-6 on [-1e-3, 0]
(-8.0e-7 on [-5, 0], 59 ulp at most there), so a running product of n of
them is off by about n x 1.35e-6 (-8.6e-5 at n = 64, -5.5e-3 at 4096). With
it this recurrence was 1.1e-5 (output) and 2.2e-5 (state) from a float64
recurrence at T = 64 on that chip, where `chunked` (one exp of a sum a chunk)
was 2.9e-6, and a layer's token-by-token decode (this backend) drifted
2.2e-5 from its full forward over 1000 tokens; on a CPU all of these are
within 3e-7. `gates.exp` is multiplies and adds with an exact power of two:
on a CPU 0.88 ulp at most and a mean signed relative error of -6.1e-10 on
[-5, 0] (-2.9e-14 on [-1e-3, 0]); rounded as a TPU v5e rounds, within 0.92
ulp (`gates.exp`).

Backend "reference": runs every call on every device (`supports` is always
None); under a context axis and for chunk-boundary states through
`context_parallel.run`.
"""

import functools

import jax
import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import common
from linear_attention.ops.kda import context_parallel
from linear_attention.ops.kda import gates
from linear_attention.ops.kda import precision as precision_lib

NAME = "reference"
supports_target = supports = backends.no_limit  # plain XLA: every call


def run(call: common.Call):
  precision = precision_lib.resolve(call.precision, call.q.dtype)
  return context_parallel.run(
      functools.partial(kda_reference, precision=precision), call)


def kda_reference(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
    precision,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments.

  `precision`: a resolved `precision.Precisions`; its `state` precision is
  that of every product (all of them read or write the state).
  """
  mm = functools.partial(jnp.einsum, precision=precision.state)
  c = common.prepare(
      q, k, v, g, beta, scale=scale, a_log=a_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
      use_qk_l2norm=use_qk_l2norm, initial_state=initial_state,
      segment_ids=segment_ids, max_num_segments=max_num_segments)
  b = q.shape[0]
  n = c.initial_state.shape[1]
  rows = jnp.arange(b)

  def step(carry, x):
    state, last_seg, finals = carry  # [B,H,K,V], [B], [B,N,H,K,V]
    q_t, k_t, v_t, g_t, beta_t, seg = x
    valid = seg > 0
    # A new run of a segment starts from that segment's initial state.
    starts = valid & (seg != last_seg)
    s = jnp.where(starts[:, None, None, None],
                  c.initial_state[rows, jnp.maximum(seg - 1, 0)], state)
    s = gates.exp(g_t)[..., None] * s  # decay, no platform exp
    pred = mm("bhk,bhkv->bhv", k_t, s)  # what the memory predicts
    s = s + mm("bhk,bhv->bhkv", k_t, beta_t[..., None] * (v_t - pred))
    o_t = mm("bhk,bhkv->bhv", q_t, s)
    # Padding leaves every state untouched and writes zero.
    state = jnp.where(valid[:, None, None, None], s, state)
    o_t = jnp.where(valid[:, None, None], o_t, 0.0)
    last_seg = jnp.where(valid, seg, last_seg)
    if output_final_state:
      mine = (jnp.arange(1, n + 1)[None, :] == seg[:, None]) & valid[:, None]
      finals = jnp.where(mine[:, :, None, None, None], state[:, None], finals)
    return (state, last_seg, finals), o_t

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (c.q, c.k, c.v, c.g, c.beta, c.segment_ids)))
  init = common.vary_like(
      (c.initial_state[:, 0], jnp.zeros((b,), jnp.int32), c.initial_state),
      xs, c.initial_state)
  (_, _, finals), o = jax.lax.scan(step, init, xs)
  return common.finish(
      time_major(o), finals, dtype=q.dtype, has_segments=c.has_segments,
      output_final_state=output_final_state)
