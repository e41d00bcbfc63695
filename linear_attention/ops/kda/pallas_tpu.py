"""Our own Pallas (Mosaic) TPU kernel for the KDA forward (phase 1).

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

Limits: float32 / bfloat16 q, k, v (one dtype; g and beta float32 or
bfloat16, computed in float32); K and V multiples of 128 (smaller head dims
would need zero padding to 128 in the wrapper, exact but not done here);
chunk a multiple of 16 up to 128 (64 is the tested and intended one); every
g >= -5; no segment_ids (NotImplementedError); forward only.

Phase 2 (not here), the backward will need: the per-chunk states X_c (store
them [B*H, N, K, V] from this kernel, or recompute them in a first pass:
T/C * K * V * 4 bytes a head), then a reverse-chunk kernel carrying dX
(float32 [K, V] scratch, grid chunks reversed through the index_map) that
recomputes A_kk, A_qk, the inverse and W, U per chunk from q, k, v, g, beta
(recompute is cheaper than storing [C, C] residuals), and forms dq, dk, dv,
dbeta and dg, the latter through the exponents' range-sum matrix transposed
(dg = E^T d(exponents)), with the same centred factors. Also: segment_ids
(run restarts inside a chunk: masked A, run-restarting range sums and state
resets at run starts), and wiring into backend "mosaic"/"auto" in api.py.
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


def _block_scores(qr, kr, k, x, token, *, c, nb, precision):
  """Unmasked score rows (A_qk, A_kk) by 16-token row blocks.

  Row block n is one [2S, K] x [K, C] product of its row-factored q and k
  (`qr`, `kr`) with the columns k * exp(column factor of block n) (`x`'s
  rows (3 + n) C ..; zero right of block n). Returns two lists of [S, C].
  """
  qk_rows, kk_rows = [], []
  for n in range(nb):
    lo = (3 + n) * c
    colf = jnp.where(token < SUB * (n + 1), jnp.exp(x[lo:lo + c]), 0.0)
    lhs = jnp.concatenate(
        [qr[SUB * n:SUB * (n + 1)], kr[SUB * n:SUB * (n + 1)]], axis=0)
    s = _dot(lhs, k * colf, _NT, precision)  # [2S, C]
    qk_rows.append(s[:SUB])
    kk_rows.append(s[SUB:])
  return qk_rows, kk_rows


def _unit_lower_solve(a, rhs, x_ref, same_block, eye, *, nb, precision):
  """(I + A)^-1 rhs for A [C, C] strictly lower, in `x_ref` (and returned).

  The diagonal 16 x 16 blocks are inverted by repeated squaring (on the
  block diagonal D: its powers stay block diagonal), then the block rows
  are solved in order.
  """
  d = jnp.where(same_block, a, 0.0)
  off = a - d
  inv, power = eye - d, d
  for _ in range(SUB.bit_length() - 2):
    power = _dot(power, power, _NN, precision)
    inv = _dot(inv, eye + power, _NN, precision)
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


def _kernel(*refs, t: Tiles):
  if t.has_initial_state:
    (e_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, sf_ref,
     state_ref, x_ref) = refs
  else:
    (e_ref, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, sf_ref, state_ref,
     x_ref) = refs
    s0_ref = None
  c, kd, vd, nb = t.chunk, t.key_dim, t.value_dim, t.blocks
  p = t.precision
  chunk_id = pl.program_id(1)

  @pl.when(chunk_id == 0)
  def _():
    if s0_ref is None:
      state_ref[...] = jnp.zeros(state_ref.shape, _F32)
    else:
      state_ref[...] = s0_ref[...].astype(_F32)

  row_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col_i = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  eye_c = row_i == col_i
  causal = row_i >= col_i
  below = row_i > col_i
  shift = SUB.bit_length() - 1  # i // 16 as a shift
  same_block = (jax.lax.shift_right_logical(row_i, shift)
                == jax.lax.shift_right_logical(col_i, shift))
  token = jax.lax.broadcasted_iota(jnp.int32, (c, kd), 0)
  eye_k = (jax.lax.broadcasted_iota(jnp.int32, (kd, kd), 0)
           == jax.lax.broadcasted_iota(jnp.int32, (kd, kd), 1))
  eye = jnp.where(eye_c, 1.0, 0.0).astype(_F32)
  emat = e_ref[...]

  for h in range(t.heads_per_block):
    q = q_ref[:, h * kd:(h + 1) * kd].astype(_F32)
    k = k_ref[:, h * kd:(h + 1) * kd].astype(_F32)
    g = g_ref[:, h * kd:(h + 1) * kd].astype(_F32)
    v = v_ref[:, h * vd:(h + 1) * vd].astype(_F32)
    beta_row = b_ref[h:h + 1, :].astype(_F32)  # [1, C]
    beta = jnp.sum(jnp.where(eye_c, beta_row, 0.0), axis=1,
                   keepdims=True)  # [C, 1], exact (one term a row)

    x = _dot(emat, g, _NN, _HIGHEST)  # [R, K] every exponent, see above
    read = jnp.exp(x[0:c])
    to_end = jnp.exp(x[c:2 * c])
    rowf = jnp.exp(x[2 * c:3 * c])
    total = jnp.exp(x[(3 + nb) * c:(3 + nb) * c + 1])  # [1, K]
    qr, kr = q * rowf, k * rowf

    qk_rows, kk_rows = _block_scores(qr, kr, k, x, token, c=c, nb=nb,
                                     precision=p.scores)
    a_qk = jnp.where(causal, jnp.concatenate(qk_rows, axis=0), 0.0)
    a = jnp.where(below, jnp.concatenate(kk_rows, axis=0), 0.0) * beta
    rhs = jnp.concatenate([read * k, v], axis=1) * beta  # [C, K + V]
    wu = _unit_lower_solve(a, rhs, x_ref, same_block, eye, nb=nb,
                           precision=p.solve)
    w, u = wu[:, :kd], wu[:, kd:]

    state = state_ref[h]  # [K, V] float32
    v_new = u - _dot(w, state, _NN, p.state)
    o = (_dot(q * read, state, _NN, p.state)
         + _dot(a_qk, v_new, _NN, p.output))
    o_ref[:, h * vd:(h + 1) * vd] = o.astype(o_ref.dtype)
    decay = jnp.sum(jnp.where(eye_k, total, 0.0), axis=1,
                    keepdims=True)  # [K, 1] exp(G_C), exact
    state_ref[h] = decay * state + _dot(k * to_end, v_new, _TN, p.state)

  @pl.when(chunk_id == pl.num_programs(1) - 1)
  def _():
    sf_ref[...] = state_ref[...]


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
           segment_ids, interpret):
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
  if not isinstance(g, jax.core.Tracer):
    g_min = float(jnp.min(g)) if g.size else 0.0
    if g_min < MIN_LOG_DECAY:
      raise ValueError(
          f"pallas_tpu needs every log decay g >= {MIN_LOG_DECAY}; the"
          f" smallest here is {g_min}.")


def kda_forward(q, k, v, g, beta, initial_state=None, *, precision,
                chunk=DEFAULT_CHUNK, heads_per_block=None, lower_bound=None,
                segment_ids=None, interpret=False):
  """The KDA forward on prepared inputs, as one Pallas TPU kernel.

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
  return _forward_only(tiles, q, k, v, g, beta, initial_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_only(t: Tiles, q, k, v, g, beta, initial_state):
  return _forward(t, q, k, v, g, beta, initial_state)


def _forward_only_fwd(t, q, k, v, g, beta, initial_state):
  return _forward(t, q, k, v, g, beta, initial_state), None


def _forward_only_bwd(t, residuals, cotangents):
  del t, residuals, cotangents
  raise NotImplementedError(
      "pallas_tpu.kda_forward is forward only (no backward kernel yet);"
      " differentiate the op with backend='chunked'.")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(t: Tiles, q, k, v, g, beta, initial_state):
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  c, hb = t.chunk, t.heads_per_block
  n = -(-seq // c)
  pad = n * c - seq
  if pad:  # k = v = beta = 0 and g = 0: the padding leaves the state alone
    padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(padt, (q, k, v, g, beta))
  tp = n * c
  nh = h // hb
  flat = lambda x: x.reshape(b, tp, h * x.shape[-1])
  beta_rows = jnp.transpose(beta.reshape(b, n, c, h), (0, 1, 3, 2)).reshape(
      b, n, nh, hb, c)
  emat = jnp.asarray(exponent_matrix(c))

  tok = lambda d: pl.BlockSpec((pl.squeezed, c, hb * d),
                               lambda i, j: (i // nh, j, i % nh))
  state = pl.BlockSpec((hb, kd, vd), lambda i, j: (i, 0, 0))
  in_specs = [
      pl.BlockSpec((t.exponent_rows, c), lambda i, j: (0, 0)),
      tok(kd), tok(kd), tok(vd), tok(kd),
      pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, hb, c),
                   lambda i, j: (i // nh, j, i % nh, 0, 0)),
  ]
  args = [emat, flat(q), flat(k), flat(v), flat(g), beta_rows]
  if t.has_initial_state:
    in_specs.append(state)
    args.append(initial_state.astype(_F32).reshape(b * h, kd, vd))
  budget = vmem_bytes(t, q.dtype, g.dtype)
  o, final = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=(b * nh, n), in_specs=in_specs,
          out_specs=[tok(vd), state],
          scratch_shapes=[pltpu.VMEM((hb, kd, vd), _F32),
                          pltpu.VMEM((c, kd + vd), _F32)]),
      out_shape=[jax.ShapeDtypeStruct((b, tp, h * vd), q.dtype),
                 jax.ShapeDtypeStruct((b * h, kd, vd), _F32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"),
          vmem_limit_bytes=int(min(max(32 * 2 ** 20, 2 * budget),
                                   100 * 2 ** 20))),
      cost_estimate=cost_estimate(b, tp, h, kd, vd, q.dtype, t),
      interpret=t.interpret,
  )(*args)
  o = o.reshape(b, tp, h, vd)[:, :seq]
  return o, final.reshape(b, h, kd, vd)
