"""Chunked KDA in XLA: the WY / UT-transform form, exact for any decay.

Kimi Linear (arXiv 2510.26692, §3.2). Split the sequence into chunks of
C tokens (`chunk_size`: 16 on CPU, 64 elsewhere). Inside a chunk, with
incoming state X and G_i the cumulative log decay from the chunk start up to
and including token i:

    A[i, j]   = beta_i sum_d k_id k_jd exp(G_id - G_jd)      (j < i)
    M         = (I + A)^-1 Diag(beta)                        (unit lower solve)
    W = M (exp(G) * K),   U = M V                            (the UT transform)
    V_new     = U - W X                                      (delta-rule errors)
    O         = (Q * exp(G)) X + tril(A_qk) V_new,  A_qk[i, j] = q_i . (exp(G_i - G_j) * k_j)
    X_next    = exp(G_C) * X + (exp(G_C - G) * K)^T V_new

Files: `linalg.py` (range sums, masked exponents, the blocked UT solve and
the matmuls, with closed-form VJPs), `intra.py` (block sizes, a chunk's
decays and scores, the UT transform, affine state maps), `grouped.py` (the
dense schedule), `segmented.py` (the packed-segment schedule); this file is
the entry point. `ops/kda/chunked_naive.py` is the same algebra on one page.

Schedule (`grouped.dense_core`, inputs without segments). A `lax.scan` over groups
of chunks (about 1024 tokens x heads at K = 64) carries the state: inside a
step the group's intra-chunk work is batched (scores, solve, UT transform),
the group's chunks update the state one after another (two matmuls each: W X,
then the update above), and the outputs of the whole group are read in one
batched pass. Every intermediate stays in cache; a whole-sequence pass makes
each one a DRAM round trip (measured in docs/performance.md). The step is `jax.checkpoint`ed, so the backward
recomputes a group from its inputs and state instead of storing [.., C, C]
residuals. With segments, a chunk's state update is its affine map X_next =
T_c X + R_c with T_c = Diag(exp(G_C)) - (exp(G_C - G) K)^T W and R_c =
(exp(G_C - G) K)^T U (a segment start resets the state between them), run
group by group in the same checkpointed scan (`segmented.packed_core`);
only when final states are asked for do the pieces run over all chunks at
once with the maps scanned (`segmented.packed_core_with_finals`: the per-segment final
states read the carried state of any chunk, at the price of memory that
grows with chunks x state).

Numerics. Nothing overflows at any decay (a chunk of 64 tokens at
lower_bound=-5 spans -320; pre-activated decays may go to -1000 and below):
exp(G_i - G_j) is never split as exp(G_i) exp(-G_j) over a chunk, and every
exponent is a sum of g over its own range (never a difference of two long
cumulative sums, which would lose ulp(G) of absolute precision). The chunk is
cut into blocks of S tokens (`block_size`: 16; 32 or 64 under a lower-bound
gate above -5, where S * |lower_bound| <= 80). A pair in different blocks
factors exactly into three exponents, each <= 0: within the row's block, the
whole blocks between, and within the column's block, so each block's scores
are one matmul of [2S, K] rows and [C, K] columns. Inside a block the pair
factors as exp(incl_i) exp(-incl_j) when |incl| <= 80 (always under a
lower-bound gate); otherwise a runtime branch uses the exact masked exponent
on [16, 16, K]. A 16-token chunk is a single block. Range sums are matmuls
with 0/1 matrices (`linalg.range_sums`); the UT transform is a blocked forward
substitution on 16 x 16 blocks (`linalg.ut_solve`). Accumulation is float32
throughout (float64 for float64 inputs: `common.compute_dtype`).

Gradients. Range sums, the UT solve (its VJP is a back substitution) and the
matmuls whose autodiff form is slow on CPU have custom VJPs (closed forms; a
forward+backward at (1, 4096, 4, 64) is ~30% faster than with autodiff through
them), so the backend supports reverse-mode differentiation only (`jax.grad`,
`jax.vjp`; `jax.jvp` raises). Measured against a float64 recurrence at T =
4096 (bounds -5 and -1): 4e-7 relative L2 on the output.

Packed segments (see `common`): a run of a segment may start anywhere inside a
chunk. Cumulative decays restart at each run start, A and A_qk are masked to
pairs in the same run, tokens of a run that started before the chunk read the
carried state, and tokens of a run that starts inside it read their segment's
initial state.
"""

import functools

import jax.numpy as jnp

from linear_attention.ops import backends
from linear_attention.ops.kda import common
from linear_attention.ops.kda import context_parallel
from linear_attention.ops.kda import precision as precision_lib
from linear_attention.ops.kda.chunked import grouped
from linear_attention.ops.kda.chunked import intra
from linear_attention.ops.kda.chunked import segmented

# The tuning rules, for callers and tests.
SUB = intra.SUB
block_size = intra.block_size
group_size = grouped.group_size

CHUNK_SIZES = (16, 64)  # the chunk sizes the tests cover
NAME = "chunked"
supports_target = supports = backends.no_limit  # plain XLA: every call


def run(call: common.Call):
  """Backend "chunked": the call through `context_parallel.run`."""
  local = functools.partial(
      kda_chunked, chunk_size=call.chunk_size, group_width=call.group_width,
      precision=precision_lib.resolve(call.precision, call.q.dtype))
  return context_parallel.run(local, call)


def kda_chunked(
    q, k, v, g, beta, *, scale, a_log=None, dt_bias=None, lower_bound=None,
    use_gate_in_kernel=False, use_qk_l2norm=False, initial_state=None,
    output_final_state=False, segment_ids=None, max_num_segments=None,
    chunk_size=None, group_width=None, precision,
):
  """See `linear_attention.ops.kimi_delta_attention` for the arguments.

  `chunk_size` (one of `CHUNK_SIZES`) defaults to the platform's
  (`backends.chunk_size`), `group_width` to `grouped.GROUP_WIDTH`;
  `precision` is a resolved `precision.Precisions`.
  """
  dtype = common.compute_dtype(q, k, v, g, beta, initial_state)
  prep = functools.partial(
      common.prepare, scale=scale, a_log=a_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
      use_qk_l2norm=use_qk_l2norm, max_num_segments=max_num_segments,
      dtype=dtype)
  chunk = backends.chunk_size() if chunk_size is None else chunk_size
  tiling = intra.Tiling(
      chunk, *intra.block_size(lower_bound, use_gate_in_kernel, chunk),
      group_width=grouped.GROUP_WIDTH if group_width is None else group_width)
  has_segments = segment_ids is not None
  if has_segments:
    cn = prep(q, k, v, g, beta, initial_state=initial_state,
              segment_ids=segment_ids)
    if output_final_state:
      o, final = segmented.packed_core_with_finals(
          cn.q, cn.k, cn.v, cn.g, cn.beta, cn.segment_ids, cn.initial_state,
          init_given=initial_state is not None, tiling=tiling,
          precision=precision)
    else:
      o = segmented.packed_core(
          cn.q, cn.k, cn.v, cn.g, cn.beta, cn.segment_ids, cn.initial_state,
          init_given=initial_state is not None, tiling=tiling,
          precision=precision)
      final = cn.initial_state
  else:
    b, _, h, kd = q.shape
    init = (jnp.zeros((b, h, kd, v.shape[-1]), dtype)
            if initial_state is None else jnp.asarray(initial_state, dtype))
    # Tokens are prepared group by group, inside the grouped scan.
    per_token = functools.partial(prep, initial_state=None, segment_ids=None)
    o, final = grouped.dense_core(q, k, v, g, beta, init, prep=per_token,
                                  tiling=tiling, precision=precision)
  return common.finish(o, final, dtype=q.dtype, has_segments=has_segments,
                       output_final_state=output_final_state)
