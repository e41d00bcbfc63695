"""Our own Pallas (Mosaic) TPU kernels for the KDA forward and backward.

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692), the chunked WY / UT
form of `chunked/__init__.py` and `chunked_naive.py`, fused into one
`pallas_call` whose grid walks the chunks of a sequence with the state in
VMEM. Per chunk of C tokens, per head, with X the incoming state:

    A_kk[i, j] = beta_i k_i . (exp(G_i - G_j) k_j)        (j < i)
    A_qk[i, j] = q_i . (exp(G_i - G_j) k_j)               (j <= i)
    [W | U]    = (I + A_kk)^-1 Diag(beta) [exp(G) K | V]
    V_new      = U - W X
    O          = (exp(G) Q) X + A_qk V_new
    X'         = exp(G_C) X + (exp(G_C - G) K)^T V_new

Inputs are PREPARED (`common.prepare`, in XLA before the kernel): q scaled
(and L2-normalised when asked), k normalised, g the activated log decay,
beta the write strength. The design, VMEM budget and FLOPs are in
docs/kernel.md; in short:

Layout. The op's own [B, T, H, K] layout viewed as [B, T, H*K] (a free
reshape, no transpose): a block is (C, hb*K) lanes of hb heads of one batch
row, so every block's last two dims are (C, multiple of 128). beta goes to
a row per head and chunk, [B, T/C, H/hb, hb, C] (a transpose of the small
[B, T, H] array), whose block (hb, C) is its array's own last two dims; the
kernel turns the row into a column by a masked lane reduction. States are
[B*H, K, V] float32, one (hb, K, V) block per head block.

Grid (B*H/hb, T/C): head blocks "parallel", chunks "arbitrary" (innermost),
the float32 state of the block's hb heads carried in VMEM scratch across the
chunk axis (loaded from `initial_state` at chunk 0, written to the final
state at the last chunk). The hb heads of a block are unrolled in the body.

Exponents. Every exponent is a sum of g over its own range, computed by one
matmul of a constant 0/+-1/+-0.5 matrix with the chunk's g at HIGHEST
(`exponent_matrix`): G_i (reads of the chunk-start state), G_C - G_j (writes
to the next state), and per 16-token row block n the centred factors
exp(incl_i - half_n) (rows) and exp(half_n + sum(j, 16n-1]) or
exp(half_n - incl_j) (columns), half_n half the block's total, so that for a
causal pair the product is exactly exp(G_i - G_j) and each factor lies in
[e^-40, e^40] when every g >= -5: nothing is split as exp(G_i) exp(-G_j)
over the chunk (a 64-token chunk spans exponents down to -320). The limit is
per 16-token block: |sum of g| <= 80, which `lower_bound` >= -5 guarantees
(MIN_LOG_DECAY); beyond ~176 a factor overflows.

Solve. (I + A)^-1 on 16 x 16 diagonal blocks by repeated squaring on the
block diagonal ((I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8)), then block
forward substitution over the C/16 row blocks (rows in a VMEM scratch).

Precision (`precision.Precisions`): range sums HIGHEST always; A_kk and A_qk
`scores`; the diagonal inverses and the substitution `solve`; W X, Q X and
the state update `state`; A_qk V_new `output`. DEFAULT runs the product on
bfloat16 operands (one MXU pass, explicitly: the operands are cast), HIGH
and HIGHEST on float32 operands with Mosaic's bf16x3 / fp32 contraction.
Interpret mode on CPU computes HIGH and HIGHEST as exact float32 products
(only DEFAULT's rounding shows there).

Backward (`jax.custom_vjp` of `kda_forward`). The forward also writes each
chunk's incoming state X_c ([B*H, T/C, K, V] float32, T/C * 64 KiB a head
at K = V = 128); a second kernel walks the chunks last to first (the index
maps reverse the chunk axis) with dX, the state's cotangent, in VMEM
scratch, recomputes each chunk's exponents, scores and UT transform from
q, k, v, g, beta and X_c (cheaper than storing [C, C] residuals), and forms
dq, dk, dv, dbeta, dg and the initial state's cotangent
(`_backward_kernel` has the equations). The transposed solve is a block
back substitution; dg is one HIGHEST product with the exponent matrix
transposed (dg = E^T dx).

Limits: float32 / bfloat16 q, k, v (one dtype; g and beta float32 or
bfloat16, computed in float32); K and V multiples of 128 (smaller head dims
would need zero padding to 128 in the wrapper, exact but not done here);
chunk a multiple of 16 up to 128 (64 is the tested and intended one); every
g >= -5; no segment_ids (NotImplementedError). Not yet: segment_ids (run
restarts inside a chunk: masked A, run-restarting range sums and state
resets at run starts), and wiring into the op's backends.
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from linear_attention.ops import backends
from linear_attention.ops.kda.precision import Precisions

SUB = 16  # tokens per block of the exponent factors and of the solve
LANES = 128  # K and V must be multiples of this
MIN_LOG_DECAY = -5.0  # every g >= this: 16 tokens span at most 80
MAX_CHUNK = 128
DEFAULT_CHUNK = 64
DEFAULT_HEADS_PER_BLOCK = 4  # the largest divisor of H up to this

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Static kernel configuration."""

  chunk: int  # C tokens per grid step
  heads_per_block: int  # hb heads per grid step
  key_dim: int  # K
  value_dim: int  # V
  has_initial_state: bool
  precision: Precisions
  interpret: bool
  save_states: bool = False  # also output each chunk's incoming state

  @property
  def blocks(self) -> int:
    return self.chunk // SUB

  @property
  def exponent_rows(self) -> int:
    return (3 + self.blocks) * self.chunk + 8


def exponent_matrix(chunk: int) -> np.ndarray:
  """[(3 + C/16) C + 8, C] float32: every exponent the kernel takes.

  Multiplied by a chunk's g [C, K], its row blocks give (each a float32 sum
  of g over exactly its range, the coefficients 0, +-1, +-0.5 exact in
  bfloat16 so that HIGHEST on a TPU loses nothing):

    [0, C)            G_i = sum of g over [0, i]           (read)
    [C, 2C)           G_C - G_j = sum over (j, C)          (to the end)
    [2C, 3C)          incl_i - half_n, i in block n        (row factors)
    [3C + nC, 3C + (n+1)C), n < C/16: column factors for row block n:
                      half_n + sum over (j, 16n)  for j before block n,
                      half_n - incl_j             for j in block n,
                      0 (masked in the kernel)    for j after it;
    the last 8 rows   G_C (the chunk's total decay), repeated,

  with incl_i the sum over [16n, i] inside i's block n and half_n half of
  block n's total. For a causal pair (j <= i, i in block n) row + column is
  exactly G_i - G_j. When every 16-token block sums to >= -80 (g >= -5),
  the row factors and the diagonal block's column factors lie in
  [-40, 40], and the earlier blocks' column factors are <= 0 (they may
  underflow to 0 only where the true product is below e^-47).
  """
  c = chunk
  i = np.arange(c)
  blk = i // SUB
  le = i[None, :] <= i[:, None]  # [row i, col l]: l <= i
  same = blk[:, None] == blk[None, :]
  read = le * 1.0
  to_end = (i[None, :] > i[:, None]) * 1.0
  row = (same & le) - 0.5 * same
  cols = []
  for n in range(c // SUB):
    in_n = (blk == n)[None, :] * 0.5
    before = ((i[None, :] > i[:, None]) & (i[None, :] < SUB * n)) * 1.0
    inside = -1.0 * ((i[None, :] >= SUB * n) & le)
    m = np.where((blk < n)[:, None], before + in_n,
                 np.where((blk == n)[:, None], inside + in_n, 0.0))
    cols.append(m)
  total = np.ones((8, c))
  return np.concatenate([read, to_end, row, *cols, total],
                        axis=0).astype(np.float32)


def _dot(a, b, dims, precision):
  """A float32-accumulated product at `precision` (DEFAULT: bf16 operands)."""
  if precision == jax.lax.Precision.DEFAULT:
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    precision = None
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=_F32)


def _block_scores(qr, kr, k, colfs, *, nb, precision):
  """Unmasked score rows (A_qk, A_kk) by 16-token row blocks.

  Row block n is one [2S, K] x [K, C] product of its row-factored q and k
  (`qr`, `kr`) with the columns k * colfs[n] (the column factors of block n,
  zero right of it). Returns two lists of [S, C].
  """
  qk_rows, kk_rows = [], []
  for n in range(nb):
    lhs = jnp.concatenate(
        [qr[SUB * n:SUB * (n + 1)], kr[SUB * n:SUB * (n + 1)]], axis=0)
    s = _dot(lhs, k * colfs[n], _NT, precision)  # [2S, C]
    qk_rows.append(s[:SUB])
    kk_rows.append(s[SUB:])
  return qk_rows, kk_rows


def _diagonal_inverse(a, same_block, eye, precision):
  """((I + D)^-1, A - D) for D the 16 x 16 diagonal blocks of A.

  A is strictly triangular, so D^16 = 0 and (I + D)^-1 = (I - D)(I + D^2)
  (I + D^4)(I + D^8): repeated squaring, whose powers stay block diagonal.
  """
  d = jnp.where(same_block, a, 0.0)
  inv, power = eye - d, d
  for _ in range(SUB.bit_length() - 2):
    power = _dot(power, power, _NN, precision)
    inv = _dot(inv, eye + power, _NN, precision)
  return inv, a - d


def _unit_lower_solve(a, rhs, x_ref, same_block, eye, *, nb, precision):
  """(I + A)^-1 rhs for A [C, C] strictly lower, in `x_ref` (and returned).

  The diagonal 16 x 16 blocks are inverted by repeated squaring (on the
  block diagonal D: its powers stay block diagonal), then the block rows
  are solved in order.
  """
  inv, off = _diagonal_inverse(a, same_block, eye, precision)
  x_ref[...] = jnp.zeros(x_ref.shape, _F32)
  for n in range(nb):
    rows = slice(SUB * n, SUB * (n + 1))
    r = rhs[rows]
    if n:
      # off's row block n is zero from column 16n on: the rows of x_ref
      # not solved yet (zero) do not enter.
      r = r - _dot(off[rows], x_ref[...], _NN, precision)
    x_ref[rows, :] = r
    # inv's row block n is zero outside column block n: only r enters.
    x_ref[rows, :] = _dot(inv[rows], x_ref[...], _NN, precision)
  return x_ref[...]


class _Consts:
  """Index masks shared by every head of a grid step."""

  def __init__(self, c, kd):
    row_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    self.eye_c = row_i == col_i
    self.causal = row_i >= col_i
    self.below = row_i > col_i
    shift = SUB.bit_length() - 1  # i // 16 as a shift
    self.same_block = (jax.lax.shift_right_logical(row_i, shift)
                       == jax.lax.shift_right_logical(col_i, shift))
    self.token = jax.lax.broadcasted_iota(jnp.int32, (c, kd), 0)
    self.eye_k = (jax.lax.broadcasted_iota(jnp.int32, (kd, kd), 0)
                  == jax.lax.broadcasted_iota(jnp.int32, (kd, kd), 1))
    self.eye = jnp.where(self.eye_c, 1.0, 0.0).astype(_F32)


def _column(row, eye):
  """[1, N] -> [N, 1] by a masked lane reduction (exact: one term a row)."""
  return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _row(column, eye):
  """[N, 1] -> [1, N] by a masked sublane reduction (exact)."""
  return jnp.sum(jnp.where(eye, column, 0.0), axis=0, keepdims=True)


def _chunk_pieces(q, k, v, g, beta, emat, m: _Consts, x_ref, t: Tiles):
  """One head's chunk up to the UT transform: what forward and backward share.

  beta is a column [C, 1]. Returns a dict of the exponents `x`, the factors
  read / to_end / rowf / total ([1, K]) and the column factors `colfs` (one
  [C, K] per row block), the masked scores a_qk (causal) and s (strictly
  lower, before beta), and wu = (I + beta s)^-1 beta [read k | v].
  """
  c, kd, nb, p = t.chunk, t.key_dim, t.blocks, t.precision
  x = _dot(emat, g, _NN, _HIGHEST)  # [R, K] every exponent, see above
  read = jnp.exp(x[0:c])
  to_end = jnp.exp(x[c:2 * c])
  rowf = jnp.exp(x[2 * c:3 * c])
  total = jnp.exp(x[(3 + nb) * c:(3 + nb) * c + 1])  # [1, K]
  qr, kr = q * rowf, k * rowf
  colfs = [jnp.where(m.token < SUB * (n + 1),
                     jnp.exp(x[(3 + n) * c:(4 + n) * c]), 0.0)
           for n in range(nb)]
  qk_rows, kk_rows = _block_scores(qr, kr, k, colfs, nb=nb,
                                   precision=p.scores)
  a_qk = jnp.where(m.causal, jnp.concatenate(qk_rows, axis=0), 0.0)
  s = jnp.where(m.below, jnp.concatenate(kk_rows, axis=0), 0.0)
  rhs = jnp.concatenate([read * k, v], axis=1) * beta  # [C, K + V]
  wu = _unit_lower_solve(s * beta, rhs, x_ref, m.same_block, m.eye, nb=nb,
                         precision=p.solve)
  return dict(x=x, read=read, to_end=to_end, rowf=rowf, total=total, qr=qr,
              kr=kr, colfs=colfs, a_qk=a_qk, s=s, wu=wu)


def _head_inputs(h, t: Tiles, m: _Consts, q_ref, k_ref, v_ref, g_ref, b_ref):
  """Head h's q, k, v, g [C, *] and beta column [C, 1] of a block, float32."""
  kl = slice(h * t.key_dim, (h + 1) * t.key_dim)
  vl = slice(h * t.value_dim, (h + 1) * t.value_dim)
  lanes = lambda ref, sl: ref[:, sl].astype(_F32)
  beta = _column(b_ref[h:h + 1, :].astype(_F32), m.eye_c)
  return (lanes(q_ref, kl), lanes(k_ref, kl), lanes(v_ref, vl),
          lanes(g_ref, kl), beta)


def _split_refs(refs, n_in, n_out):
  """(inputs, outputs, scratch refs) of a kernel's flat ref list."""
  return refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]


def _kernel(*refs, t: Tiles):
  n_in = 7 if t.has_initial_state else 6
  n_out = 3 if t.save_states else 2
  ins, outs, (state_ref, x_ref) = _split_refs(refs, n_in, n_out)
  e_ref, q_ref, k_ref, v_ref, g_ref, b_ref = ins[:6]
  s0_ref = ins[6] if t.has_initial_state else None
  o_ref, sf_ref = outs[:2]
  cs_ref = outs[2] if t.save_states else None
  kd, vd = t.key_dim, t.value_dim
  p = t.precision
  chunk_id = pl.program_id(1)

  @pl.when(chunk_id == 0)
  def _():
    if s0_ref is None:
      state_ref[...] = jnp.zeros(state_ref.shape, _F32)
    else:
      state_ref[...] = s0_ref[...].astype(_F32)

  m = _Consts(t.chunk, kd)
  emat = e_ref[...]
  for h in range(t.heads_per_block):
    q, k, v, g, beta = _head_inputs(h, t, m, q_ref, k_ref, v_ref, g_ref,
                                    b_ref)
    f = _chunk_pieces(q, k, v, g, beta, emat, m, x_ref, t)
    w, u = f["wu"][:, :kd], f["wu"][:, kd:]

    state = state_ref[h]  # [K, V] float32
    if cs_ref is not None:
      cs_ref[h] = state
    v_new = u - _dot(w, state, _NN, p.state)
    o = (_dot(q * f["read"], state, _NN, p.state)
         + _dot(f["a_qk"], v_new, _NN, p.output))
    o_ref[:, h * vd:(h + 1) * vd] = o.astype(o_ref.dtype)
    decay = _column(f["total"], m.eye_k)  # [K, 1] exp(G_C), exact
    state_ref[h] = decay * state + _dot(k * f["to_end"], v_new, _TN, p.state)

  @pl.when(chunk_id == pl.num_programs(1) - 1)
  def _():
    sf_ref[...] = state_ref[...]


def _unit_upper_solve_t(a, rhs, x_ref, same_block, eye, *, nb, precision):
  """(I + A)^-T rhs for A [C, C] strictly lower: block back substitution.

  A^T comes from a HIGHEST product with the identity (exact: one term an
  entry; I A^T, the transposed-RHS form the forward's scores use too); its
  diagonal blocks are inverted by repeated squaring as in
  `_unit_lower_solve`, and the block rows are solved last to first.
  """
  at = _dot(eye, a, _NT, _HIGHEST)  # A^T, strictly upper
  inv, off = _diagonal_inverse(at, same_block, eye, precision)
  x_ref[...] = jnp.zeros(x_ref.shape, _F32)
  for n in reversed(range(nb)):
    rows = slice(SUB * n, SUB * (n + 1))
    r = rhs[rows]
    if n < nb - 1:
      # off's row block n is zero up to column 16(n + 1): only the rows
      # already solved (below) enter.
      r = r - _dot(off[rows], x_ref[...], _NN, precision)
    x_ref[rows, :] = r
    x_ref[rows, :] = _dot(inv[rows], x_ref[...], _NN, precision)
  return x_ref[...]


def _scores_backward(d_aqk, ds, k, f, *, nb, precision):
  """Cotangents through `_block_scores`, row block by row block.

  Block n's scores are [qr; kr]_n (k colf_n)^T; with dS_n its rows of
  (dA_qk, dS): d[qr; kr]_n = dS_n (k colf_n), d(k colf_n) = dS_n^T [qr; kr]_n.
  Returns (dqr, dkr, dk from the columns, the column factors' exponent
  cotangents (one [C, K] per block)).
  """
  dqr_rows, dkr_rows, dcols = [], [], []
  dk = jnp.zeros(k.shape, _F32)
  for n in range(nb):
    rows = slice(SUB * n, SUB * (n + 1))
    dsn = jnp.concatenate([d_aqk[rows], ds[rows]], axis=0)  # [2S, C]
    lhs = jnp.concatenate([f["qr"][rows], f["kr"][rows]], axis=0)
    kc = k * f["colfs"][n]
    dlhs = _dot(dsn, kc, _NN, precision)  # [2S, K]
    dkc = _dot(dsn, lhs, _TN, precision)  # [C, K]
    dk = dk + dkc * f["colfs"][n]
    dcols.append(dkc * kc)
    dqr_rows.append(dlhs[:SUB])
    dkr_rows.append(dlhs[SUB:])
  return (jnp.concatenate(dqr_rows, axis=0), jnp.concatenate(dkr_rows, axis=0),
          dk, dcols)


def _backward_kernel(*refs, t: Tiles):
  """One head block's chunks last to first, dX (the state's cotangent) in VMEM.

  Per chunk and head it recomputes the forward's pieces from q, k, v, g,
  beta and the chunk's incoming state X (saved by the forward), then, with
  dO the output's and dX' the outgoing state's cotangent:

      dV_new = A_qk^T dO + (exp(G_C - G) K) dX'
      dX     = (exp(G) Q)^T dO + exp(G_C) dX' - W^T dV_new
      [dW | dU] = [-dV_new X^T | dV_new],  dR = (I + A)^-T [dW | dU]
      dA     = -tril_strict(dR [W | U]^T)

  (A = beta S, R = beta [exp(G) K | V])

  and the scores' products transposed per row block. Every factor is an
  exponential of a row of x = E g (`exponent_matrix`), so the gradient of
  g is one HIGHEST product dg = E^T dx, dx the factors' cotangents times
  the factors.
  """
  (e_ref, et_ref, q_ref, k_ref, v_ref, g_ref, b_ref, cs_ref, do_ref,
   dsf_ref), outs, (dstate_ref, x_ref) = _split_refs(refs, 10, 6)
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref = outs
  c, kd, vd, nb, p = t.chunk, t.key_dim, t.value_dim, t.blocks, t.precision
  step = pl.program_id(1)

  @pl.when(step == 0)  # the last chunk: dX' is the final state's cotangent
  def _():
    dstate_ref[...] = dsf_ref[...].astype(_F32)

  m = _Consts(c, kd)
  emat, emat_t = e_ref[...], et_ref[...]
  tail = jax.lax.broadcasted_iota(jnp.int32, (8, kd), 0) == 0
  for h in range(t.heads_per_block):
    kl, vl = slice(h * kd, (h + 1) * kd), slice(h * vd, (h + 1) * vd)
    q, k, v, g, beta = _head_inputs(h, t, m, q_ref, k_ref, v_ref, g_ref,
                                    b_ref)
    f = _chunk_pieces(q, k, v, g, beta, emat, m, x_ref, t)
    read, to_end, rowf, total = f["read"], f["to_end"], f["rowf"], f["total"]
    wu = f["wu"]
    w, u = wu[:, :kd], wu[:, kd:]
    state = cs_ref[h]  # X, [K, V]
    v_new = u - _dot(w, state, _NN, p.state)
    do = do_ref[:, vl].astype(_F32)
    dnext = dstate_ref[h]  # dX'
    kend, qread = k * to_end, q * read

    dv_new = (_dot(f["a_qk"], do, _TN, p.output)
              + _dot(kend, dnext, _NN, p.state))
    dstate_ref[h] = (_dot(qread, do, _TN, p.state)
                     + _column(total, m.eye_k) * dnext
                     - _dot(w, dv_new, _TN, p.state))
    d_aqk = jnp.where(m.causal, _dot(do, v_new, _NT, p.output), 0.0)
    d_qread = _dot(do, state, _NT, p.state)  # [C, K]
    d_kend = _dot(v_new, dnext, _NT, p.state)  # [C, K]
    d_total = _row(jnp.sum(state * dnext, axis=1, keepdims=True), m.eye_k)
    dwu = jnp.concatenate([-_dot(dv_new, state, _NT, p.state), dv_new],
                          axis=1)
    dr = _unit_upper_solve_t(f["s"] * beta, dwu, x_ref, m.same_block, m.eye,
                             nb=nb, precision=p.solve)
    da = jnp.where(m.below, -_dot(dr, wu, _NT, p.solve), 0.0)
    kread = read * k
    dbeta = (jnp.sum(da * f["s"], axis=1, keepdims=True)
             + jnp.sum(dr * jnp.concatenate([kread, v], axis=1), axis=1,
                       keepdims=True))  # [C, 1]
    ds = da * beta
    dr_w = dr[:, :kd] * beta
    dv = dr[:, kd:] * beta
    dq = d_qread * read
    dk = d_kend * to_end + dr_w * read
    d_read = d_qread * q + dr_w * k

    dqr, dkr, dk_cols, dcols = _scores_backward(d_aqk, ds, k, f, nb=nb,
                                                precision=p.scores)
    dq = dq + dqr * rowf
    dk = dk + dk_cols + dkr * rowf
    dx = jnp.concatenate(
        [d_read * read, d_kend * k * to_end, dqr * f["qr"] + dkr * f["kr"],
         *dcols, jnp.where(tail, d_total * total, 0.0)], axis=0)  # [R, K]
    dg = _dot(emat_t, dx, _NN, _HIGHEST)  # [C, K] = E^T dx

    dq_ref[:, kl] = dq
    dk_ref[:, kl] = dk
    dv_ref[:, vl] = dv
    dg_ref[:, kl] = dg
    db_ref[h:h + 1, :] = _row(dbeta, m.eye_c)

  @pl.when(step == pl.num_programs(1) - 1)  # chunk 0: dX is the initial's
  def _():
    ds0_ref[...] = dstate_ref[...]


def flops_per_chunk(chunk: int, key_dim: int, value_dim: int) -> int:
  """Matmul FLOPs of one head and one chunk (see docs/kernel.md)."""
  c, kd, vd = chunk, key_dim, value_dim
  nb = c // SUB
  rows = (3 + nb) * c + 8
  n = kd + vd
  sums = 2 * rows * c * kd
  scores = nb * 2 * (2 * SUB) * kd * c
  inverse = 2 * (SUB.bit_length() - 2) * 2 * c ** 3
  substitution = (2 * nb - 1) * 2 * SUB * c * n
  state = 3 * 2 * c * kd * vd  # W X, Q X, the update
  output = 2 * c * c * vd
  return sums + scores + inverse + substitution + state + output


def cost_estimate(b, t, h, kd, vd, dtype, t_: Tiles) -> pl.CostEstimate:
  """FLOPs, exps and HBM bytes of one call (for XLA's scheduler)."""
  n = t // t_.chunk
  heads_chunks = b * h * n
  item = jnp.dtype(dtype).itemsize
  tokens = b * t * h
  hbm = (tokens * (3 * kd + vd) * item  # q, k, g, v (g counted at q's size)
         + tokens * vd * item  # o
         + tokens * 4  # beta
         + b * h * kd * vd * 4 * (2 if t_.has_initial_state else 1))
  exps = heads_chunks * (t_.exponent_rows - 8 + 1) * kd
  return pl.CostEstimate(
      flops=int(heads_chunks * flops_per_chunk(t_.chunk, kd, vd)),
      transcendentals=int(exps), bytes_accessed=int(hbm))


def vmem_bytes(t: Tiles, in_dtype, g_dtype) -> int:
  """VMEM of one grid step's buffers (double-buffered blocks + scratch).

  Blocks are padded to (8, 128) tiles (16 sublanes for bf16); the live
  intermediates of one unrolled head (about 24 [C, max(C, 128)] float32
  values and the [R, K] exponents) come on top, counted once.
  """
  c, kd, vd, hb = t.chunk, t.key_dim, t.value_dim, t.heads_per_block
  item, gitem = jnp.dtype(in_dtype).itemsize, jnp.dtype(g_dtype).itemsize
  lanes = lambda n: -(-n // LANES) * LANES
  blocks = (hb * c * (2 * kd + vd) * item  # q, k, v
            + hb * c * kd * gitem  # g
            + max(hb, 8) * lanes(c) * 4  # beta rows
            + t.exponent_rows * lanes(c) * 4  # the exponent matrix
            + hb * c * vd * item  # o
            + hb * kd * vd * 4 * (2 if t.has_initial_state else 1))
  scratch = hb * kd * vd * 4 + c * (kd + vd) * 4
  live = 24 * c * lanes(max(c, kd, vd)) * 4 + t.exponent_rows * kd * 4
  return 2 * blocks + scratch + live


def _heads_per_block(h, heads_per_block):
  if heads_per_block is None:
    return max(d for d in range(1, min(h, DEFAULT_HEADS_PER_BLOCK) + 1)
               if h % d == 0)
  if heads_per_block < 1 or h % heads_per_block:
    raise NotImplementedError(
        f"pallas_tpu needs heads_per_block to divide H; got"
        f" heads_per_block={heads_per_block}, H={h}.")
  return heads_per_block


def _check(q, k, v, g, beta, initial_state, *, chunk, lower_bound,
           segment_ids, interpret, raw_gate=False):
  """The kernels' limits; `raw_gate`: g is the gate's input, not checked."""
  if segment_ids is not None:
    raise NotImplementedError(
        "pallas_tpu.kda_forward has no packed segments yet (segment_ids);"
        " use backend='chunked'.")
  if not interpret and backends.target_platform() != "tpu":
    raise NotImplementedError(
        "pallas_tpu.kda_forward compiles with Mosaic, which needs a TPU; the"
        f" default device is {jax.default_backend()}. Pass interpret=True"
        " (Pallas interpret mode, slow), or export it for a TPU inside"
        " `linear_attention.ops.kda.mosaic.lowering_mode()`.")
  if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
    raise ValueError(f"q, k, g must be [B, T, H, K] of one shape; got"
                     f" {q.shape}, {k.shape}, {g.shape}.")
  b, t, h, kd = q.shape
  if v.ndim != 4 or v.shape[:3] != (b, t, h) or beta.shape != (b, t, h):
    raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H] for q"
                     f" {q.shape}; got {v.shape}, {beta.shape}.")
  vd = v.shape[-1]
  if initial_state is not None and initial_state.shape != (b, h, kd, vd):
    raise ValueError(f"initial_state must be [B, H, K, V] = {(b, h, kd, vd)};"
                     f" got {initial_state.shape}.")
  floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
  if q.dtype not in floats or k.dtype != q.dtype or v.dtype != q.dtype:
    raise NotImplementedError(
        "pallas_tpu supports float32 or bfloat16 q, k, v of one dtype; got"
        f" q {q.dtype}, k {k.dtype}, v {v.dtype}.")
  if g.dtype not in floats or beta.dtype not in floats:
    raise NotImplementedError(
        f"pallas_tpu supports float32 or bfloat16 g and beta; got g"
        f" {g.dtype}, beta {beta.dtype}.")
  if kd % LANES or vd % LANES:
    raise NotImplementedError(
        f"pallas_tpu needs K and V to be multiples of {LANES} (TPU lanes);"
        f" got K={kd}, V={vd}.")
  if chunk % SUB or not SUB <= chunk <= MAX_CHUNK:
    raise NotImplementedError(
        f"pallas_tpu needs chunk to be a multiple of {SUB} in [{SUB},"
        f" {MAX_CHUNK}]; got chunk={chunk}.")
  if lower_bound is not None and lower_bound < MIN_LOG_DECAY:
    raise NotImplementedError(
        f"pallas_tpu needs every log decay g >= {MIN_LOG_DECAY} (its"
        f" exponent factors span 16 tokens); got lower_bound={lower_bound}.")
  if not raw_gate and not isinstance(g, jax.core.Tracer):
    g_min = float(jnp.min(g)) if g.size else 0.0
    if g_min < MIN_LOG_DECAY:
      raise ValueError(
          f"pallas_tpu needs every log decay g >= {MIN_LOG_DECAY}; the"
          f" smallest here is {g_min}.")


def kda_forward(q, k, v, g, beta, initial_state=None, *, precision,
                chunk=DEFAULT_CHUNK, heads_per_block=None, lower_bound=None,
                segment_ids=None, interpret=False):
  """The KDA forward on prepared inputs, as one Pallas TPU kernel.

  Differentiable in reverse mode (q, k, v, g, beta, initial_state): the VJP
  is the backward kernel, fed by the chunk states the forward then saves.

  Args:
    q, k, g: [B, T, H, K]; q scaled (and normalised), k normalised, g the
      activated log decay, every g in [-5, 0] (see `lower_bound`).
    v: [B, T, H, V].
    beta: [B, T, H].
    initial_state: [B, H, K, V] or None (zeros).
    precision: a `precision.Precisions` (resolved; "auto" is the op's).
    chunk: C tokens per grid step, a multiple of 16 up to 128.
    heads_per_block: heads per grid step (a divisor of H); default the
      largest divisor of H up to 4.
    lower_bound: the gate's lower bound when g comes from the lower-bound
      gate: checked (>= -5) at trace time. Concrete g are checked too.
    segment_ids: not supported yet (NotImplementedError unless None).
    interpret: run in Pallas interpret mode (any device; slow: tests).
      Without it the kernel compiles with Mosaic, which needs a TPU (or
      `mosaic.lowering_mode` for export): NotImplementedError otherwise.

  Returns:
    (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] float32).
  """
  if not isinstance(precision, Precisions):
    raise ValueError(f"precision must be a Precisions; got {precision!r}.")
  _check(q, k, v, g, beta, initial_state, chunk=chunk,
         lower_bound=lower_bound, segment_ids=segment_ids,
         interpret=interpret)
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  hb = _heads_per_block(h, heads_per_block)
  tiles = Tiles(chunk=chunk, heads_per_block=hb, key_dim=kd, value_dim=vd,
                has_initial_state=initial_state is not None,
                precision=precision, interpret=bool(interpret))
  return _kda(tiles, q, k, v, g, beta, initial_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(t: Tiles, q, k, v, g, beta, initial_state):
  return _forward(t, q, k, v, g, beta, initial_state)


def _kda_fwd(t, q, k, v, g, beta, initial_state):
  o, final, states = _forward(dataclasses.replace(t, save_states=True),
                              q, k, v, g, beta, initial_state)
  return (o, final), (q, k, v, g, beta, initial_state, states)


def _kda_bwd(t, residuals, cotangents):
  q, k, v, g, beta, initial_state, states = residuals
  do, dfinal = cotangents
  dq, dk, dv, dg, dbeta, ds0 = _backward(t, q, k, v, g, beta, states, do,
                                         dfinal)
  cast = lambda x, like: x.astype(like.dtype)
  return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dg, g),
          cast(dbeta, beta),
          None if initial_state is None else cast(ds0, initial_state))


_kda.defvjp(_kda_fwd, _kda_bwd)


def _layout(t: Tiles, b, seq, h, *, reverse=False):
  """(n chunks, padded T, block specs) shared by the forward and backward."""
  c, hb = t.chunk, t.heads_per_block
  n = -(-seq // c)
  nh = h // hb
  at = (lambda j: n - 1 - j) if reverse else (lambda j: j)
  tok = lambda d: pl.BlockSpec((pl.squeezed, c, hb * d),
                               lambda i, j: (i // nh, at(j), i % nh))
  rows = pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, hb, c),
                      lambda i, j: (i // nh, at(j), i % nh, 0, 0))
  state = pl.BlockSpec((hb, t.key_dim, t.value_dim), lambda i, j: (i, 0, 0))
  chunk_state = pl.BlockSpec((hb, pl.squeezed, t.key_dim, t.value_dim),
                             lambda i, j: (i, at(j), 0, 0))
  emat = pl.BlockSpec((t.exponent_rows, c), lambda i, j: (0, 0))
  return n, n * c, dict(tok=tok, rows=rows, state=state,
                        chunk_state=chunk_state, emat=emat)


def _pad_time(tp, *xs):
  """Zero-pads each [B, T, ...] array to T = tp (None stays None)."""
  def pad(x):
    if x is None or x.shape[1] == tp:
      return x
    return jnp.pad(x, [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return [pad(x) for x in xs]


def _beta_rows(beta, n, c, nh, hb):
  """[B, T, H] -> [B, T/C, H/hb, hb, C]: a row of C per head and chunk."""
  b, _, h = beta.shape
  return jnp.transpose(beta.reshape(b, n, c, h), (0, 1, 3, 2)).reshape(
      b, n, nh, hb, c)


def _params(budget):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary"),
      vmem_limit_bytes=int(min(max(32 * 2 ** 20, 2 * budget), 100 * 2 ** 20)))


@functools.partial(jax.jit, static_argnums=(0,))
def _backward(t: Tiles, q, k, v, g, beta, states, do, dfinal):
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  c, hb = t.chunk, t.heads_per_block
  nh = h // hb
  n, tp, spec = _layout(t, b, seq, h, reverse=True)
  # Padding (k = v = beta = g = 0, dO = 0) adds nothing to any gradient.
  q, k, v, g, beta, do = _pad_time(tp, q, k, v, g, beta, do)
  flat = lambda x: x.reshape(b, tp, h * x.shape[-1])
  tok = spec["tok"]
  emat_t = pl.BlockSpec((c, t.exponent_rows), lambda i, j: (0, 0))
  in_specs = [spec["emat"], emat_t, tok(kd), tok(kd), tok(vd), tok(kd),
              spec["rows"], spec["chunk_state"], tok(vd), spec["state"]]
  emat = exponent_matrix(c)
  args = [jnp.asarray(emat), jnp.asarray(emat.T.copy()), flat(q), flat(k),
          flat(v), flat(g),
          _beta_rows(beta, n, c, nh, hb), states, flat(do),
          dfinal.astype(_F32).reshape(b * h, kd, vd)]
  shape = lambda d: jax.ShapeDtypeStruct((b, tp, h * d), _F32)
  dq, dk, dv, dg, db, ds0 = pl.pallas_call(
      functools.partial(_backward_kernel, t=t),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=(b * nh, n), in_specs=in_specs,
          out_specs=[tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"],
                     spec["state"]],
          scratch_shapes=[pltpu.VMEM((hb, kd, vd), _F32),
                          pltpu.VMEM((c, kd + vd), _F32)]),
      out_shape=[shape(kd), shape(kd), shape(vd), shape(kd),
                 jax.ShapeDtypeStruct((b, n, nh, hb, c), _F32),
                 jax.ShapeDtypeStruct((b * h, kd, vd), _F32)],
      compiler_params=_params(2 * vmem_bytes(t, q.dtype, g.dtype)),
      interpret=t.interpret,
  )(*args)
  unflat = lambda x, d: x.reshape(b, tp, h, d)[:, :seq]
  dbeta = jnp.transpose(db.reshape(b, n, h, c), (0, 1, 3, 2)).reshape(
      b, tp, h)[:, :seq]
  return (unflat(dq, kd), unflat(dk, kd), unflat(dv, vd), unflat(dg, kd),
          dbeta, ds0.reshape(b, h, kd, vd))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(t: Tiles, q, k, v, g, beta, initial_state):
  """(o, final state[, chunk states [B*H, T/C, K, V] with t.save_states])."""
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  c, hb = t.chunk, t.heads_per_block
  nh = h // hb
  n, tp, spec = _layout(t, b, seq, h)
  # k = v = beta = 0 and g = 0: the padding leaves the state alone.
  q, k, v, g, beta = _pad_time(tp, q, k, v, g, beta)
  flat = lambda x: x.reshape(b, tp, h * x.shape[-1])
  tok = spec["tok"]
  in_specs = [spec["emat"], tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"]]
  args = [jnp.asarray(exponent_matrix(c)), flat(q), flat(k), flat(v), flat(g),
          _beta_rows(beta, n, c, nh, hb)]
  if t.has_initial_state:
    in_specs.append(spec["state"])
    args.append(initial_state.astype(_F32).reshape(b * h, kd, vd))
  out_specs = [tok(vd), spec["state"]]
  out_shape = [jax.ShapeDtypeStruct((b, tp, h * vd), q.dtype),
               jax.ShapeDtypeStruct((b * h, kd, vd), _F32)]
  if t.save_states:
    out_specs.append(spec["chunk_state"])
    out_shape.append(jax.ShapeDtypeStruct((b * h, n, kd, vd), _F32))
  out = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=(b * nh, n), in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((hb, kd, vd), _F32),
                          pltpu.VMEM((c, kd + vd), _F32)]),
      out_shape=out_shape,
      compiler_params=_params(vmem_bytes(t, q.dtype, g.dtype)),
      cost_estimate=cost_estimate(b, tp, h, kd, vd, q.dtype, t),
      interpret=t.interpret,
  )(*args)
  o = out[0].reshape(b, tp, h, vd)[:, :seq]
  return (o, out[1].reshape(b, h, kd, vd), *out[2:])
