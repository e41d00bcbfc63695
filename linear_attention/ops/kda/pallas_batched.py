"""Our Pallas TPU KDA forward, with the heads of a grid step batched.

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692) in the chunked WY / UT
form (`chunked_naive.py`): one `pallas_call` whose grid walks the chunks of
a sequence with the float32 state in VMEM. Per chunk of C tokens and head,
with X the incoming state and G_i the sum of g over the chunk up to token i:

    A_kk[i, j] = beta_i k_i . (exp(G_i - G_j) k_j)        (j < i)
    A_qk[i, j] = q_i . (exp(G_i - G_j) k_j)               (j <= i)
    [W | U]    = (I + A_kk)^-1 Diag(beta) [exp(G) K | V]
    V_new      = U - W X
    O          = (exp(G) Q) X + A_qk V_new
    X'         = exp(G_C) X + (exp(G_C - G) K)^T V_new

Inputs are prepared (`common.prepare`): q scaled (and normalised), k
normalised, g the activated log decay in [-5, 0], beta the write strength.

What differs from `pallas_tpu.kda_forward` (same grid and blocks, same
exponent safety), measured on a TPU v5e in docs/kernel.md:

* Every per-head step is one batched op over the hb heads of the grid step
  ([hb, C, *] arrays stacked from the block's 128-lane head slices), so the
  hb independent chains of small matmuls are issued together instead of one
  head after another; the elementwise work runs on the whole [C, hb*K]
  block.
* The exponents come from one [2C, C] 0/1 matrix (16-token local prefix
  and suffix sums) times g split into three bfloat16 pieces (exact: the
  matrix is exact in bfloat16 and every piece's product is exact), instead
  of a [(3 + C/16) C + 8, C] matrix at HIGHEST (six passes); the prefix
  and suffix sums and the per-block factors are then formed on the vector
  unit from the local sums and the block totals (|sum| <= 80 when g >= -5,
  so no factor overflows and no exponent is a difference of two sums over
  more than 16 tokens: whole-block totals are added, never subtracted).
* The solve is blocked twice: the 16 x 16 diagonal blocks D are inverted by
  repeated squaring ((I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8)), then
  with G = (I + D)^-1 F for the off-diagonal part F, (I + A)^-1 =
  (I + G)^-1 (I + D)^-1 and (I + G)^-1 = (I - G)(I + G^2)... (G is block
  strictly lower: G^(C/16) = 0). The inverse is formed as one [C, C]
  matrix and applied once to [K | V] (and, transposed, to the backward's
  cotangents): eleven batched products at C = 64, ten of them [C, C] x
  [C, C], no row-block substitution through a scratch.

The backward kernel (`_backward_kernel`, behind a custom VJP) walks the
chunks last to first with the state's cotangent in VMEM, recomputing each
chunk from the chunk-start states the forward saves. `kda` takes the op's
raw inputs and prepares them in the forward kernel; `strided=True` reads
the op's own layout as rows (docs/kernel.md). Its backward kernel
(`fused_backward=True`, the default) prepares each raw block as the forward
does, pulls the gradients back through the L2 norm, the scale and the gate
per block, writes them in the inputs' dtypes, and sums the a_log and
dt_bias gradients over the chunks in a block that stays put along the chunk
axis. With `fused_backward=False` the backward prepares q, k and g in XLA
and pulls the kernel's float32 gradients back there (`jax.vjp`): on a TPU
v5e that XLA glue (float32 relayouts of dq, dk, dg, prepared copies, the
pull-back fusions) took about 7 of its 12.0 ms of forward+backward device
time, and the fused form takes 6.9 ms in all (B1 T8192 H32 K128 bfloat16).

Packed segments (`kda(..., segment_ids=...)`, training's form: no initial or
final state): each chunk reads its run-start counts and padding flags
(`_run_rows`) and masks pairs to runs and the carried state's reads and
writes to the runs that hold it (`_run_masks`); the exponents do not change.

Chunk-boundary states (`kda(..., chunk_states_every=C)`, C a multiple of
the chunk): the forward kernel also writes its carried state at the last
chunk of every piece of C tokens, into a [hb, K, V] block whose index
moves once a piece (the tail after the last boundary stays on the last
block, so no block is revisited); the backward kernel adds each boundary
state's cotangent to dX' at the same chunk. One pass of each kernel, with
or without packed segments (not with per-segment states, whose layout
moves runs off the boundaries).

Limits (NotImplementedError): q, k, v float32 or bfloat16 of one dtype; K and
V multiples of 128; chunk 16 * 2^n up to 128; every g >= -5 (the fused gate
only with lower_bound); segments not strided; chunk-boundary states at
multiples of the chunk, without per-segment states.
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from linear_attention.ops.kda import common
from linear_attention.ops.kda import gates
from linear_attention.ops.kda import pallas_tpu
from linear_attention.ops.kda.precision import Precisions

SUB = pallas_tpu.SUB
LANES = pallas_tpu.LANES
DEFAULT_HEADS_PER_BLOCK = 8  # the largest divisor of H up to this

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_BATCH_NN = (((2,), (1,)), ((0,), (0,)))  # [b, m, k] @ [b, k, n]
_BATCH_NT = (((2,), (2,)), ((0,), (0,)))  # [b, m, k] @ [b, n, k]^T


@dataclasses.dataclass(frozen=True)
class Prep:
  """The op's input preparation, when the forward kernel does it itself.

  On the raw block: q and k L2-normalised per head (`l2norm`), q times
  `scale`, and with `lower_bound` the fused gate g = lower_bound *
  sigmoid(exp(a_log) (g + dt_bias)) (else g is already the log decay).
  """

  l2norm: bool
  scale: float
  lower_bound: float | None


@dataclasses.dataclass(frozen=True)
class Config:
  """Static kernel configuration."""

  chunk: int
  heads_per_block: int
  key_dim: int
  value_dim: int
  has_initial_state: bool
  precision: Precisions
  interpret: bool
  save_states: bool = False  # also output each chunk's incoming state
  prep: Prep | None = None  # the forward prepares raw inputs itself
  # Read and write the op's own [B, T, H, *] layout as rows [B*T*H, *] (a
  # free view when H fills the TPU's row tiles), every head a strided row
  # load, all H heads a step: no relayout copies around the kernel.
  strided: bool = False
  # With `prep`: the backward kernel prepares the raw q, k, g itself and
  # pulls its gradients back through the preparation (a_log and dt_bias
  # summed in the kernel), writing them in the inputs' dtypes (the default:
  # 1.7x faster on a v5e); else the backward prepares in XLA and pulls back
  # there (`_kda_raw_bwd`).
  fused_backward: bool = True
  # With `strided` and the fused backward: None, the backward reads strided
  # rows too; else it reads the unstrided blocks, this many heads a step
  # (`_backward_config`). The chunk states the forward saves are [B*H, n,
  # K, V] in either layout, so either backward takes them.
  backward_heads_per_block: int | None = None
  # The configuration a call that is not differentiated runs (the custom
  # VJP's primal; `kda(..., strided_primal=True)`: the strided forward, all
  # heads a step), or None: this one. A differentiated call runs this one
  # forward and backward.
  primal: "Config | None" = None
  # Packed segments (`segment_ids`, without initial or final states): each
  # chunk also reads its run rows (`_run_rows`) and restricts its pairs and
  # its use of the carried state to runs (`_run_masks`).
  segmented: bool = False
  # Per-run states (`_realign`: every run of a segment moved to start on a
  # chunk edge): at most this many runs a row, each starting from its own
  # state block and leaving its final state in one (0: off). The kernels
  # then read two scalar-prefetched rows: each chunk's run, and its flags
  # (1: a run starts here, 2: a run ends here).
  run_states: int = 0
  # Chunk-boundary states (`kda(..., chunk_states_every=...)`): the carried
  # state after every `boundary_chunks` chunks, for the first `boundaries`
  # such pieces (those wholly inside the sequence), is also written out, one
  # [hb, K, V] block each, and the backward adds their cotangents to the
  # carried state's at those chunks (0: off).
  boundary_chunks: int = 0
  boundaries: int = 0

  @property
  def blocks(self) -> int:
    return self.chunk // SUB

  @property
  def gated(self) -> bool:
    return self.prep is not None and self.prep.lower_bound is not None


class _Operand:
  """A float32 value that several products read.

  Its bfloat16 head (a DEFAULT product's operand) and tail (with the head,
  a HIGH product's, `_split2`) are formed at the first product that needs
  them and reused by the others; for a plain array `_dot` forms them anew
  at every product, and the kernel's program would hold each repeat. An
  operand made by `_Operand.of` (row slices, concatenations, negations:
  maps that commute with the split, exactly) takes its value, head and
  tail from its sources', so it splits nothing again.
  """

  def __init__(self, value, source=None):
    self._value = None if value is None else value.astype(_F32)
    self._source = source  # (fn, operands) for `of`
    self._head = self._tail = None

  @classmethod
  def of(cls, fn, *operands):
    """fn(*operands), fn a map that commutes with rounding to bfloat16."""
    return cls(None, (fn, [_operand(x) for x in operands]))

  def _derived(self, get):
    fn, operands = self._source
    return fn(*[get(x) for x in operands])

  @property
  def value(self):
    if self._value is None:
      self._value = self._derived(lambda x: x.value)
    return self._value

  def head(self):
    if self._head is None:
      self._head = (self.value.astype(_BF16) if self._source is None
                    else self._derived(lambda x: x.head()))
    return self._head

  def parts(self):
    """(head, tail), both bfloat16: head + tail keeps 16 of float32's 24
    mantissa bits."""
    if self._tail is None:
      self._tail = (
          (self.value - self.head().astype(_F32)).astype(_BF16)
          if self._source is None
          else self._derived(lambda x: x.parts()[1]))
    return self.head(), self._tail


def _operand(x):
  return x if isinstance(x, _Operand) else _Operand(x)


def _lower_dot(a, b, zero_rows, precision):
  """a @ b ([hb, C, n] x [hb, n, m]) for a whose first `zero_rows` rows
  are 0: only the other rows go through the matrix unit (its work grows
  with the rows a product streams), and the product's first rows are 0."""
  if zero_rows == 0:
    return _dot(a, b, _BATCH_NN, precision)
  rest = _dot(_Operand.of(lambda x: x[:, zero_rows:], a), b, _BATCH_NN,
              precision)
  zeros = jnp.zeros((rest.shape[0], zero_rows, rest.shape[2]), _F32)
  return jnp.concatenate([zeros, rest], axis=1)


def _dot(a, b, dims, precision):
  """A float32-accumulated product at `precision`, the same on every device.

  DEFAULT: one product of bfloat16 operands. HIGH: three, written out (the
  bf16x3 scheme Mosaic lowers HIGH to): each operand split into a bfloat16
  head and tail, head.head + (head.tail + tail.head), so that interpret mode
  on a CPU (where a HIGH product is exact float32) has the chip's
  rounding. HIGHEST: float32 operands (Mosaic's fp32 contraction). a and b
  are arrays or `_Operand`s (split once for all their products).
  """
  a, b = _operand(a), _operand(b)
  bf = lambda x, y: jax.lax.dot_general(x, y, dims,
                                        preferred_element_type=_F32)
  if precision == jax.lax.Precision.DEFAULT:
    return bf(a.head(), b.head())
  if precision == jax.lax.Precision.HIGH:
    (ah, at), (bh, bt) = a.parts(), b.parts()
    return bf(ah, bh) + (bf(ah, bt) + bf(at, bh))
  return jax.lax.dot_general(a.value, b.value, dims, precision=precision,
                             preferred_element_type=_F32)


def _split2(x):
  """x ~= head + tail, both bfloat16 (16 of float32's 24 mantissa bits)."""
  return _Operand(x).parts()


def _split3(x):
  """x = a + b + c, each bfloat16 (exact for float32 x): `_split2`'s head
  and tail, and what the tail leaves."""
  a, b = _split2(x)
  return a, b, (x - a.astype(_F32) - b.astype(_F32)).astype(_BF16)


def _local_matrix(c, transpose=False):
  """[2C, C] 0/1 (bfloat16, exact): the 16-token local sums.

  Row i < C sums over [16 floor(i / 16), i] (the local prefix sums L), row
  C + i over (i, 16 floor(i / 16) + 16) (the local suffix sums, the tails).
  Built from iotas; `transpose` gives [C, 2C].
  """
  shape = (c, 2 * c) if transpose else (2 * c, c)
  r = jax.lax.broadcasted_iota(jnp.int32, shape, 1 if transpose else 0)
  j = jax.lax.broadcasted_iota(jnp.int32, shape, 0 if transpose else 1)
  i = r % c
  shift = SUB.bit_length() - 1
  same = jax.lax.shift_right_logical(i, shift) == jax.lax.shift_right_logical(
      j, shift)
  one = lambda cond: jnp.where(cond, 1.0, 0.0)  # (no selects on booleans)
  return jnp.where(r < c, one(same & (j <= i)),
                   one(same & (j > i))).astype(_BF16)


def _exact_dot(m, x):
  """m @ x for m exact in bfloat16: x in three bfloat16 pieces, so every
  product is exact and the sums accumulate in float32 (HIGHEST's result at
  half its passes)."""
  out = None
  for piece in _split3(x):
    y = jax.lax.dot_general(m, piece, (((1,), (0,)), ((), ())),
                            preferred_element_type=_F32)
    out = y if out is None else out + y
  return out


def _block_rows(parts, n_lanes):
  """[C, N] whose 16-row block m is the row parts[m] [1, N], repeated."""
  return jnp.concatenate([jnp.broadcast_to(p, (SUB, n_lanes)) for p in parts],
                         axis=0)


def _between(totals, halves, m, n):
  """h_n + T_{m+1} + ... + T_{n-1} (block totals added, never subtracted)."""
  out = halves[n]
  for p in range(m + 1, n):
    out = out + totals[p]
  return out


def _block_sums(totals):
  """([T_0 + ... + T_{m-1}], [T_{m+1} + ... + T_{nb-1}]) for each block m
  (rows [1, N]; 0 for none)."""
  zero = jnp.zeros_like(totals[0])
  before, after = [zero], [zero]
  for t_m in totals[:-1]:
    before.append(before[-1] + t_m)
  for t_m in totals[:0:-1]:
    after.insert(0, t_m + after[0])
  return before, after


def _factors(g, c, nb):
  """Exponent factors of one chunk, for every head at once ([C, hb*K]).

  Returns read = exp(G), to_end = exp(G_C - G), total = exp(G_C) [1, N],
  rowf, and colfs (one [C, N] per 16-token row block n): for a causal pair
  j <= i with i in block n, rowf[i] * colfs[n][j] = exp(G_i - G_j). With
  L the local prefix sums, T_m block m's total and h_n = T_n / 2:
  rowf[i] = exp(L_i - h_n); colfs[n][j] = exp(h_n - L_j) in block n,
  exp(h_n + T_{m+1} + ... + T_{n-1} + (T_m - L_j)) in an earlier block m,
  and 0 after block n. Every exponent of a row factor or of block n's own
  column factors lies in [-40, 40] when g >= -5, and earlier blocks' are
  <= 0: no factor overflows. (A form with fewer exponentials, 267 rows of
  [1, N] a chunk instead of 353, each in-block tail's exp once times one
  exponential row per block pair, took the same time on a v5e, 2.59
  against 2.58 ms forward at B1 T8192 H32, and was removed.)

  Only the local sums come from the matrix unit (`_exact_dot`, [2C, C]):
  L and the tails R (the sums over the rest of a token's block); the
  prefix sums G_i = T_0 + ... + T_{m-1} + L_i (i in block m) and the suffix
  sums G_C - G_i = R_i + T_{m+1} + ... + T_{nb-1} are formed from them on
  the vector unit, block totals added, never subtracted (the [3C, C]
  matrix of prefix, suffix and local sums took 1.5x the matrix unit's row
  passes; a tail taken as T_m - L_i lost up to 4.3e-6 of exp(G_C - G_i) to
  cancellation, against 3.8e-8 summed).
  """
  x = _exact_dot(_local_matrix(c), g)
  local, tail = x[:c], x[c:]
  n_lanes = g.shape[1]
  totals = [local[SUB * m + SUB - 1:SUB * m + SUB] for m in range(nb)]
  before, after = _block_sums(totals)
  halves = [0.5 * t for t in totals]
  rowf = jnp.exp(local - _block_rows(halves, n_lanes))
  big = _block_rows(before, n_lanes) + local  # sum over [0, i]
  suffix = tail + _block_rows(after, n_lanes)  # sum over (i, C)
  colfs = []
  for n in range(nb):
    pieces = []
    for m in range(nb):
      sl = slice(SUB * m, SUB * (m + 1))
      if m > n:
        pieces.append(jnp.zeros((SUB, n_lanes), _F32))
      elif m == n:
        pieces.append(jnp.exp(halves[n] - local[sl]))
      else:
        pieces.append(jnp.exp(_between(totals, halves, m, n) + tail[sl]))
    colfs.append(jnp.concatenate(pieces, axis=0))
  return dict(read=jnp.exp(big), to_end=jnp.exp(suffix),
              total=jnp.exp(big[c - 1:c]), rowf=rowf, colfs=colfs)


def _factors_backward(f, d, c, nb):
  """dg [C, N] from the cotangents d of `_factors`' outputs.

  Each factor is exp(e) for an exponent e built from the local sums L,
  the tails R and the block totals; d e = d factor * factor flows back to
  L and R (the totals are local sums too), and dg = M^T d[L; R] for the
  local-sum matrix M (`_local_matrix`). The halves h_n are constants: every
  product rowf[i] * colfs[n][j] is free of h_n, so its exact cotangent is
  zero (summing the rows' and the columns' large, opposite terms would only
  add rounding).
  """
  n_lanes = f["read"].shape[1]
  # Per 16-row block (aligned slices): no masks over [C, N], and a colfs
  # cotangent ([16 (n + 1), N], `_scores_backward`) only where it is not 0.
  blocks = lambda x: [x[SUB * m:SUB * (m + 1)] for m in range(
      x.shape[0] // SUB)]
  rowsum = lambda x: jnp.sum(x, axis=0, keepdims=True)
  d_big = blocks(d["read"] * f["read"])
  d_suffix = blocks(d["to_end"] * f["to_end"])
  # big = rows(before) + local, suffix = tail + rows(after), and the total
  # G_C = T_0 + ... + T_{nb-1}.
  d_local = [a + b for a, b in zip(blocks(d["rowf"] * f["rowf"]), d_big)]
  d_tail = list(d_suffix)
  d_totals = [d["total"] * f["total"]] * nb
  for m in range(nb):
    if m > 0:  # before[m] = T_0 + ... + T_{m-1}
      d_before = rowsum(d_big[m])
      for p in range(m):
        d_totals[p] = d_totals[p] + d_before
    if m < nb - 1:  # after[m] = T_{m+1} + ... + T_{nb-1}
      d_after = rowsum(d_suffix[m])
      for p in range(m + 1, nb):
        d_totals[p] = d_totals[p] + d_after
  for n in range(nb):
    e = blocks(d["colfs"][n] * f["colfs"][n][:SUB * (n + 1)])
    for m in range(n):  # exp(h_n + T_{m+1} + ... + T_{n-1} + R_j)
      em = rowsum(e[m])
      for p in range(m + 1, n):
        d_totals[p] = d_totals[p] + em
      d_tail[m] = d_tail[m] + e[m]
    d_local[n] = d_local[n] - e[n]  # exp(h_n - L_j)
  last = jax.lax.broadcasted_iota(jnp.int32, (SUB, n_lanes), 0) == SUB - 1
  for m in range(nb):  # totals[m] = local[16m + 15]
    d_local[m] = d_local[m] + jnp.where(last, d_totals[m], 0.0)
  return _exact_dot(_local_matrix(c, transpose=True),
                    jnp.concatenate(d_local + d_tail, axis=0))


def _heads(x, hb, d):
  """[C, hb*d] -> [hb, C, d] (128-lane slices: whole vregs, no shuffles)."""
  return jnp.stack([x[:, h * d:(h + 1) * d] for h in range(hb)], axis=0)


def _lanes(x):
  """[hb, C, d] -> [C, hb*d], the inverse of `_heads`."""
  return jnp.concatenate([x[h] for h in range(x.shape[0])], axis=1)


def _eye(n):
  return (jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
          == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1))


def _column(rows, n):
  """[hb, 1, n] -> [hb, n, 1] by a masked lane reduction (exact)."""
  return jnp.sum(jnp.where(_eye(n)[None], rows, 0.0), axis=2, keepdims=True)


def _row(columns, n):
  """[hb, n, 1] -> [hb, 1, n] by a masked sublane reduction (exact)."""
  return jnp.sum(jnp.where(_eye(n)[None], columns, 0.0), axis=1,
                 keepdims=True)


def _tri_masks(c):
  ri = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  ci = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  shift = SUB.bit_length() - 1
  same = (jax.lax.shift_right_logical(ri, shift)
          == jax.lax.shift_right_logical(ci, shift))
  return dict(causal=(ri >= ci)[None], below=(ri > ci)[None], same=same[None],
              eye=jnp.where(ri == ci, 1.0, 0.0).astype(_F32)[None])


RUN_ROWS = 8  # rows of a chunk's run block (one sublane tile; 2 used)


def _run_rows(segment_ids, n, c, at_edges=False):
  """Packed segments as [B, n, 8, C] float32, one block per chunk: row 0 the
  run starts (`common.segment_runs`) from the chunk's first token up to each
  token, row 1 1 for a token and 0 for padding (time padding included), the
  rest 0 (the block fills a sublane tile). With `at_edges` (`_realign`'s
  layout: runs start on chunk edges, where the kernels set the state) row 0
  is 0: every token reads the state its chunk starts from."""
  b, seq = segment_ids.shape
  ids = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, n * c - seq)])
  if at_edges:
    starts = jnp.zeros((b, n, c), jnp.int32)
  else:
    _, _, start = common.segment_runs(ids)
    starts = jnp.cumsum(start.reshape(b, n, c).astype(jnp.int32), axis=2)
  rows = jnp.stack([starts, (ids > 0).reshape(b, n, c)], axis=2)
  return jnp.pad(rows.astype(_F32),
                 [(0, 0), (0, 0), (0, RUN_ROWS - 2), (0, 0)])


def _run_masks(runs, masks, c):
  """A chunk's masks with packed segments, from its run rows [8, C].

  Two tokens interact only inside one run, so the causal and strictly lower
  pair masks keep pairs with equal run-start counts. Returns those masks and
  the 0/1 columns [1, C, 1] carry (the token's run began before the chunk:
  it reads the carried state), last (the token is in the chunk's last run:
  it writes the outgoing state) and keep (a token, not padding), and
  carry_end [1, 1, 1] (no run starts in the chunk: the carried state
  decays through it). A run that starts reads a zero state (no initial
  states with segments).
  """
  row = runs[0:1]  # [1, C]
  col = _column(row[None], c)  # [1, C, 1]
  same = col == row[None]  # [1, C, C]
  # The last token's count, the largest (counts never fall), [1, 1, 1].
  end = jnp.max(row, axis=1, keepdims=True)[None]
  one = lambda cond: jnp.where(cond, 1.0, 0.0)
  return (dict(masks, causal=masks["causal"] & same,
               below=masks["below"] & same),
          dict(carry=one(col == 0.0), last=one(col == end),
               keep=_column(runs[1:2][None], c), carry_end=one(end == 0.0)))


def _solve_factors(a, masks, nb, precision):
  """(inv, [G, G^2, ...]) with (I + A)^-1 = (I + G)^-1 inv, batched
  (`_Operand`s: each is read by more than one product).

  inv = (I + D)^-1 for D the 16 x 16 diagonal blocks of A (strictly lower),
  by repeated squaring ((I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8),
  D^16 = 0), and G = inv F for the off-diagonal part F: block strictly
  lower, so G^nb = 0 and (I + G)^-1 = (I - G)(I + G^2)...(I + G^(nb/2)).
  G^(2^p) is 0 in its first 16 2^p rows (F in its first 16), and
  `_lower_dot` leaves those out of the products (`_lower_rows`).
  """
  eye = masks["eye"]
  d = jnp.where(masks["same"], a, 0.0)
  inv, power = eye - d, _Operand(d)
  for _ in range(SUB.bit_length() - 2):
    power = _Operand(_dot(power, power, _BATCH_NN, precision))
    inv = _dot(inv, eye + power.value, _BATCH_NN, precision)
  inv, powers = _Operand(inv), []
  if nb > 1:
    gm = _Operand(_lower_dot(inv, a - d, SUB, precision))
    powers.append(gm)
    for p in range(1, nb.bit_length() - 1):
      gm = _Operand(_lower_dot(gm, gm, _lower_rows(p), precision))
      powers.append(gm)
  return inv, powers


def _lower_rows(p):
  """The rows at the top of G^(2^p) that are 0 (G block strictly lower)."""
  return SUB << p


def _inverse(inv, powers, precision):
  """(I + A)^-1 = (I + G)^-1 inv [hb, C, C] (an `_Operand`), from
  `_solve_factors`.

  Formed once and applied once to the [C, K + V] right-hand side (and,
  transposed, to the backward's): applying inv and then each factor of
  (I + G)^-1 to the wide right-hand side took as many products, each twice
  the matrix unit's row passes of a [C, C] x [C, C] one
  (`benchmarks/kda_kernel_program.py`).
  """
  x = inv
  for p, gm in enumerate(powers):
    gx = _lower_dot(gm, x, _lower_rows(p), precision)
    x = _operand(x).value - gx if p == 0 else x + gx
  return _operand(x)


def _read(ref, t: "Config"):
  """A token block as [C, hb*d] float32 (heads side by side in lanes)."""
  if not t.strided:
    return ref[...].astype(_F32)
  hb = t.heads_per_block
  return jnp.concatenate(
      [ref[pl.ds(h, t.chunk, stride=hb), :].astype(_F32) for h in range(hb)],
      axis=1)


def _write(ref, x2, t: "Config", rows=None):
  """`_read`'s inverse: x2 [C, hb*d] into a token block. Strided, a 16-bit
  block goes through `rows`, a float32 scratch of C*hb rows and at least d
  lanes (`_rows_scratch`)."""
  if not t.strided:
    ref[...] = x2.astype(ref.dtype)
    return
  hb = t.heads_per_block
  d = x2.shape[1] // hb
  wide = jnp.dtype(ref.dtype).itemsize == 4
  to = ref if wide else (rows if rows.shape[1] == d
                         else rows.at[:, pl.ds(0, d)])
  for h in range(hb):
    to[pl.ds(h, t.chunk, stride=hb), :] = x2[:, h * d:(h + 1) * d].astype(
        to.dtype)
  if not wide:
    ref[...] = to[...].astype(ref.dtype)


def _read_beta(ref, t: "Config"):
  """beta as columns [hb, C, 1] (blocks: rows (hb, C), or (C, H) strided)."""
  b = ref[...].astype(_F32)
  if t.strided:
    return jnp.stack([b[:, h:h + 1] for h in range(t.heads_per_block)])
  return _column(b[:, None, :], t.chunk)


def _write_beta(ref, columns, t: "Config"):
  """`_read_beta`'s inverse for the cotangent [hb, C, 1]."""
  if t.strided:
    ref[...] = jnp.concatenate(
        [columns[h] for h in range(t.heads_per_block)], axis=1)
  else:
    ref[...] = _row(columns, t.chunk)[:, 0, :]


def _chunk(q2, k2, v2, g2, beta, t: "Config", masks):
  """One chunk up to the UT transform, for the hb heads of a grid step.

  q2, k2, g2 [C, hb*K], v2 [C, hb*V] float32, beta [hb, C, 1] columns.
  Returns the factors `f`, the per-head (q|k) row-factored scores' inputs,
  the masked scores a_qk (causal) and s (strictly lower, before beta), the
  beta column [hb, C, 1], the inverse (I + A)^-1 and wu = [W | U]: the stages
  `_factors`, `_scores` and `_ut`, in turn.
  """
  f = _factors(g2, t.chunk, t.blocks)
  x = _scores(q2, k2, f, t, masks)
  return _ut(x, k2, v2, beta, t, masks)


def _scores(q2, k2, f, t: "Config", masks):
  """The chunk's masked scores from the exponent factors `f`: a dict of f,
  qr, kr (the row-factored q, k), lhs and kcs (per row block n, [qr; kr]
  over its rows and the column-factored k: `_Operand`s, which the backward
  reads again), a_qk and s_kk."""
  hb, kd, nb = t.heads_per_block, t.key_dim, t.blocks
  kh = lambda x: _heads(x, hb, kd)
  qr, kr = kh(q2 * f["rowf"]), kh(k2 * f["rowf"])
  kcs = [_Operand(kh(k2 * cf)) for cf in f["colfs"]]
  qk_rows, kk_rows, lhss = [], [], []
  for n in range(nb):
    rows = slice(SUB * n, SUB * (n + 1))
    lhs = _Operand(jnp.concatenate([qr[:, rows], kr[:, rows]], axis=1))
    s = _dot(lhs, kcs[n], _BATCH_NT, t.precision.scores)  # [hb, 2S, C]
    qk_rows.append(s[:, :SUB])
    kk_rows.append(s[:, SUB:])
    lhss.append(lhs)  # [hb, 2S, K]
  a_qk = jnp.where(masks["causal"], jnp.concatenate(qk_rows, axis=1), 0.0)
  s_kk = jnp.where(masks["below"], jnp.concatenate(kk_rows, axis=1), 0.0)
  return dict(f=f, qr=qr, kr=kr, lhs=lhss, kcs=kcs, a_qk=a_qk, s_kk=s_kk)


def _ut(x, k2, v2, beta, t: "Config", masks):
  """`_scores`' dict x with the UT transform added: beta, kread, v3, the
  inverse (I + A)^-1 [hb, C, C] (`_inverse`) and wu = [W | U]
  [hb, C, K + V]."""
  hb, kd, vd = t.heads_per_block, t.key_dim, t.value_dim
  kread, v3 = _heads(k2 * x["f"]["read"], hb, kd), _heads(v2, hb, vd)
  rhs = jnp.concatenate([kread, v3], axis=2) * beta
  inv, powers = _solve_factors(beta * x["s_kk"], masks, t.blocks,
                               t.precision.solve)
  inverse = _inverse(inv, powers, t.precision.solve)
  wu = _dot(inverse, rhs, _BATCH_NN, t.precision.solve)
  return dict(x, beta=beta, kread=kread, v3=v3, inverse=inverse, wu=wu)


def _unit(x2, hb, kd):
  """Each head's 128-lane rows of x2 [C, hb*K] over their L2 norm.

  Returns (x / sqrt(|x|^2 + eps), 1 / sqrt(|x|^2 + eps)) as [hb, C, K] and
  [hb, C, 1]: `gates.l2_normalize` per head, with its epsilon.
  """
  x3 = _heads(x2, hb, kd)
  inv = jax.lax.rsqrt(jnp.sum(x3 * x3, axis=2, keepdims=True)
                      + gates.L2_NORM_EPS)
  return x3 * inv, inv


def _prepare_block(q2, k2, g2, rate, dtb, t: Config):
  """The op's preparation on a raw block ([C, hb*K] float32 each).

  Returns the prepared (q2, k2, g2) and what `_prepare_block_backward`
  needs (the unit rows and inverse norms, the gate's sigmoid and its
  argument); the forward drops the latter, which costs nothing: they are
  the preparation's own intermediates.
  """
  hb, kd, prep = t.heads_per_block, t.key_dim, t.prep
  saved = {}
  if prep.l2norm:
    (saved["q_unit"], saved["q_inv"]), (saved["k_unit"], saved["k_inv"]) = (
        _unit(q2, hb, kd), _unit(k2, hb, kd))
    q2, k2 = _lanes(saved["q_unit"]), _lanes(saved["k_unit"])
  if prep.scale != 1.0:
    q2 = q2 * prep.scale
  if prep.lower_bound is not None:
    saved["u"] = rate * (g2 + dtb)
    saved["sig"] = jax.nn.sigmoid(saved["u"])
    g2 = prep.lower_bound * saved["sig"]
  return q2, k2, g2, saved


def _unit_backward(unit, inv, d):
  """The L2 norm's VJP per row: (d - x_hat <x_hat, d>) / sqrt(|x|^2 + eps).

  Exact for y = x r with r = (|x|^2 + eps)^(-1/2): dy/dx^T d = r d
  - x r^3 <x, d> = r (d - y <y, d>). unit, d [hb, C, K], inv [hb, C, 1].
  """
  return (d - unit * jnp.sum(unit * d, axis=2, keepdims=True)) * inv


def _prepare_block_backward(dq3, dk3, dg2, rate, saved, t: Config):
  """Pulls the prepared-space cotangents back through `_prepare_block`.

  dq3, dk3 [hb, C, K] (prepared q, k), dg2 [C, hb*K] (the log decay).
  Returns (dq3, dk3, dg2) of the raw block and, with the fused gate, the
  per-lane sums over the block's rows of the a_log and dt_bias terms
  ([1, hb*K] each; None without it). With s = sigmoid(u), u = exp(a_log)
  (g_raw + dt_bias) and g = lower_bound s: du = dg lower_bound s (1 - s),
  dg_raw = d dt_bias = du exp(a_log), d a_log = du u. A padding token's raw
  gate is -inf: s (1 - s) = 0 there, so dg_raw = 0, and its a_log term (0
  times u = -inf) is taken as its limit, 0.
  """
  prep = t.prep
  if prep.scale != 1.0:
    dq3 = dq3 * prep.scale
  if prep.l2norm:
    dq3 = _unit_backward(saved["q_unit"], saved["q_inv"], dq3)
    dk3 = _unit_backward(saved["k_unit"], saved["k_inv"], dk3)
  if prep.lower_bound is None:
    return dq3, dk3, dg2, None, None
  sig = saved["sig"]
  slope = sig * (1.0 - sig)
  du = dg2 * prep.lower_bound * slope
  dg2 = du * rate
  da = jnp.where(slope > 0.0, du * saved["u"], 0.0)
  return (dq3, dk3, dg2, jnp.sum(da, axis=0, keepdims=True),
          jnp.sum(dg2, axis=0, keepdims=True))


def _run_flags(refs, t: Config, chunk):
  """(the refs after the scalar-prefetched rows, this chunk's flags or
  None): with `t.run_states`, 1 where a run starts, 2 where one ends."""
  if not t.run_states:
    return refs, None
  _, flag_ref, *refs = refs
  return refs, flag_ref[pl.program_id(0) * pl.num_programs(1) + chunk]


def _kernel(*refs, t: Config):
  refs, flags = _run_flags(refs, t, pl.program_id(1))
  names = ["q", "k", "v", "g", "b"] + (["runs"] if t.segmented else [])
  names += ["rate", "dtb"] if t.gated else []
  names += ["s0"] if t.has_initial_state else []
  names += ["o", "sf"] + (["cs"] if t.save_states else [])
  names += (["bs"] if t.boundary_chunks else []) + ["state"]
  names += ["rows"] if _rows_scratch(t, refs[names.index("o")].dtype) else []
  r = dict(zip(names, refs))
  s0_ref, cs_ref, state_ref = r.get("s0"), r.get("cs"), r["state"]
  chunk_id = pl.program_id(1)

  @pl.when(chunk_id == 0)
  def _():
    if s0_ref is None or t.run_states:
      state_ref[...] = jnp.zeros(state_ref.shape, _F32)
    else:
      state_ref[...] = s0_ref[...].astype(_F32)

  if t.run_states:
    @pl.when(flags % 2 == 1)  # a run starts: from its own initial state
    def _():
      state_ref[...] = s0_ref[...].astype(_F32)

  x, q2, k2, _, seg, _, _ = _load_chunk(r, t)
  state = state_ref[...]  # [hb, K, V]
  if cs_ref is not None:
    cs_ref[...] = state
  o, new_state = _state_step(x, q2, k2, state, seg, t)
  _write(r["o"], _lanes(o), t, r.get("rows"))
  state_ref[...] = new_state
  if t.boundary_chunks:
    @pl.when(_at_boundary(chunk_id, t))
    def _():
      r["bs"][...] = new_state

  if t.run_states:  # the run's block holds its state after its last chunk
    r["sf"][...] = state_ref[...]
  else:
    @pl.when(chunk_id == pl.num_programs(1) - 1)
    def _():
      r["sf"][...] = state_ref[...]


def _at_boundary(chunk, t: Config):
  """Whether `chunk` is the last of a piece of `t.boundary_chunks` chunks
  whose outgoing state is a chunk-boundary state (one of the first
  `t.boundaries` pieces: those wholly inside the sequence)."""
  e = t.boundary_chunks
  return (chunk % e == e - 1) & (chunk // e < t.boundaries)


def _state_step(x, q2, k2, state, seg, t: Config):
  """The chunk's output [hb, C, V] and the state after it [hb, K, V], from
  `_chunk`'s dict x and the state before it (the chunk-to-chunk part: V_new
  = U - W X, O = (Q exp G) X + A_qk V_new, X' = exp(G_C) X + (K exp(G_C -
  G))^T V_new). With segments (`_run_masks`) only the rows of runs that
  began before the chunk read X, only the last run's rows write X', and
  padding outputs 0."""
  c, hb, kd, p = t.chunk, t.heads_per_block, t.key_dim, t.precision
  f, wu = x["f"], x["wu"]
  kh = lambda y: _heads(y, hb, kd)
  lhs = jnp.concatenate([wu[:, :, :kd], kh(q2 * f["read"])], axis=1)
  ws = _dot(lhs, state, _BATCH_NN, p.state)  # [hb, 2C, V]: W X and Q X
  v_new = _Operand(wu[:, :, kd:] - _rows(ws[:, :c], seg["carry"]))
  o = _rows(_rows(ws[:, c:], seg["carry"])
            + _dot(x["a_qk"], v_new, _BATCH_NN, p.output), seg["keep"])
  k_end = _rows(kh(k2 * f["to_end"]), seg["last"])  # [hb, C, K]
  decay = _rows(_column(kh(f["total"]), kd), seg["carry_end"])  # [hb, K, 1]
  return o, decay * state + _dot(jnp.swapaxes(k_end, 1, 2), v_new,
                                 _BATCH_NN, p.state)


def _rows(x, mask):
  """x times a 0/1 mask ([1, C, 1] rows, or [1, 1, 1]); x itself for None."""
  return x if mask is None else x * mask


def _unpadded(x, keep):
  """x ([C, N] lanes or [hb, C, *] heads) with padding's rows set to 0
  (keep [1, C, 1] or None); a select, so that any value there (NaN
  included) is dropped."""
  if keep is None:
    return x
  mask = keep if x.ndim == 3 else keep[0]
  return jnp.where(jnp.broadcast_to(mask, x.shape) > 0.0, x, 0.0)


_NO_RUNS = dict(carry=None, last=None, keep=None, carry_end=None)


def _load_chunk(r, t: Config):
  """A grid step's chunk from its blocks, for both kernels.

  Reads q, k, g (prepared here with `t.prep`), v and beta; with segments
  the run masks (`_run_masks`), padding's q, k, v, g and beta set to 0 as
  read (as the chunked backend does: whatever padding holds is dropped) and
  its prepared g to 0 (it then leaves the state alone and adds to no other
  token). Returns the chunk
  (`_chunk`), the prepared q2 and k2, the masks, the run columns
  (`_NO_RUNS` without segments: every mask None), the preparation's
  intermediates and the gate's rate row.
  """
  masks, seg = _tri_masks(t.chunk), _NO_RUNS
  if t.segmented:
    masks, seg = _run_masks(r["runs"][...], masks, t.chunk)
  keep = seg["keep"]
  q2, k2, g2, v2 = (_unpadded(_read(r[n], t), keep) for n in "qkgv")
  rate = r["rate"][...] if t.gated else None
  saved = None
  if t.prep is not None:
    q2, k2, g2, saved = _prepare_block(
        q2, k2, g2, rate, r["dtb"][...] if t.gated else None, t)
  beta = _unpadded(_read_beta(r["b"], t), keep)
  x = _chunk(q2, k2, v2, _unpadded(g2, keep), beta, t, masks)
  return x, q2, k2, masks, seg, saved, rate


def _scores_backward(x, d_aqk, ds, nb, precision):
  """Cotangents through the scores, row block by row block.

  Block n's scores are [qr; kr]_n (k colf_n)^T; with dS_n its rows of
  (dA_qk, dS): d[qr; kr]_n = dS_n (k colf_n), d(k colf_n) = dS_n^T [qr; kr]_n.
  Returns (dqr, dkr, [d(k colf_n)]), the last [hb, 16 (n + 1), K]: block
  n's scores reach the keys up to its end only (colf_n is 0 after it).
  """
  dqr, dkr, dkcs = [], [], []
  for n in range(nb):
    rows = slice(SUB * n, SUB * (n + 1))
    dsn = jnp.concatenate([d_aqk[:, rows], ds[:, rows]], axis=1)  # [hb,2S,C]
    dlhs = _dot(dsn, x["kcs"][n], _BATCH_NN, precision)  # [hb, 2S, K]
    # dS_n^T is 0 below row 16 (n + 1): only the rows above go through
    # the product.
    end = SUB * (n + 1)
    dkcs.append(_dot(jnp.swapaxes(dsn, 1, 2)[:, :end], x["lhs"][n],
                     _BATCH_NN, precision))
    dqr.append(dlhs[:, :SUB])
    dkr.append(dlhs[:, SUB:])
  return jnp.concatenate(dqr, axis=1), jnp.concatenate(dkr, axis=1), dkcs


def _backward_kernel(*refs, t: Config):
  """One head block's chunks last to first, dX (the state's cotangent) in VMEM.

  Recomputes the chunk's pieces (`_chunk`) from q, k, v, g, beta and the
  chunk's incoming state X (saved by the forward); then, with dO and dX'
  the cotangents of the chunk's output and outgoing state:

      dV_new    = A_qk^T dO + (exp(G_C - G) K) dX'
      dX        = (exp(G) Q)^T dO + exp(G_C) dX' - W^T dV_new
      [dW | dU] = [-dV_new X^T | dV_new],  dR = (I + A)^-T [dW | dU]
      dA        = -strict_lower(dR [W | U]^T)   (A = beta S, R = beta [exp(G) K | V])

  the scores' products transposed per row block, and the factors'
  cotangents back to g (`_factors_backward`).

  With `t.prep` (the fused backward) q, k and g are raw: the block is
  prepared as the forward kernel does (`_prepare_block`) and the gradients
  are pulled back through that preparation before they are written
  (`_prepare_block_backward`); the a_log and dt_bias terms are summed over
  the chunks into per-lane rows whose block stays put along the chunk axis.
  """
  refs, flags = _run_flags(refs, t, pl.num_programs(1) - 1 - pl.program_id(1))
  names = ["q", "k", "v", "g", "b"] + (["runs"] if t.segmented else [])
  names += ["rate", "dtb"] if t.gated else []
  names += ["cs", "do", "dsf"] + (["dbs"] if t.boundary_chunks else [])
  names += ["dq", "dk", "dv", "dg", "db", "ds0"]
  names += (["da", "ddt"] if t.gated else []) + ["dstate"]
  grads = [refs[names.index(n)].dtype for n in ("dq", "dk", "dv", "dg")]
  names += ["rows"] if _rows_scratch(t, *grads) else []
  r = dict(zip(names, refs))
  cs_ref, dstate_ref = r["cs"], r["dstate"]
  c, hb, kd, vd, nb = (t.chunk, t.heads_per_block, t.key_dim, t.value_dim,
                       t.blocks)
  p = t.precision
  step = pl.program_id(1)
  _backward_step_start(r, t, step, flags)
  x, q2, k2, masks, seg, saved, rate = _load_chunk(r, t)
  f, wu, beta = x["f"], x["wu"], x["beta"]
  kh = lambda y: _heads(y, hb, kd)
  swap = lambda y: jnp.swapaxes(y, 1, 2)
  q3, k3 = kh(q2), kh(k2)
  read3, to_end3 = kh(f["read"]), kh(f["to_end"])
  # The forward's row masks (segments; None without), on the cotangents too.
  carry, last = seg["carry"], seg["last"]
  do = _Operand(_rows(_heads(_read(r["do"], t), hb, vd), seg["keep"]))
  decay = _rows(_column(kh(f["total"]), kd), seg["carry_end"])
  w = wu[:, :, :kd]
  # Each value several products read is split once (`_Operand`).
  state = _Operand(cs_ref[...])  # X [hb, K, V]
  w_read = _rows(w, carry)
  v_new = _Operand(wu[:, :, kd:] - _dot(w_read, state, _BATCH_NN, p.state))
  dnext = _Operand(dstate_ref[...])  # dX'
  kend, qread = _rows(k3 * to_end3, last), _rows(q3 * read3, carry)

  dv_new = _Operand(_dot(swap(x["a_qk"]), do, _BATCH_NN, p.output)
                    + _dot(kend, dnext, _BATCH_NN, p.state))
  # (Q exp G)^T dO - W^T dV_new as one product over 2C: [K, 2C] x [2C, V]
  # streams K rows once, where two [K, C] x [C, V] products stream them twice.
  stacked = _Operand.of(lambda a, b: jnp.concatenate([a, b], axis=1), do,
                        dv_new)
  dstate_ref[...] = (
      _dot(swap(jnp.concatenate([qread, -w_read], axis=1)), stacked,
           _BATCH_NN, p.state) + decay * dnext.value)
  d_aqk = jnp.where(masks["causal"], _dot(do, v_new, _BATCH_NT, p.output),
                    0.0)
  d_qread = _rows(_dot(do, state, _BATCH_NT, p.state), carry)  # [hb, C, K]
  d_kend = _rows(_dot(v_new, dnext, _BATCH_NT, p.state), last)  # [hb, C, K]
  d_total = _rows(_row(jnp.sum(state.value * dnext.value, axis=2,
                               keepdims=True), kd),
                  seg["carry_end"])
  dwu = jnp.concatenate(
      [-_rows(_dot(dv_new, state, _BATCH_NT, p.state), carry), dv_new.value],
      axis=2)
  dr = _dot(swap(x["inverse"].value), dwu, _BATCH_NN, p.solve)
  da = jnp.where(masks["below"], -_dot(dr, wu, _BATCH_NT, p.solve), 0.0)
  dbeta = (jnp.sum(da * x["s_kk"], axis=2, keepdims=True)
           + jnp.sum(dr * jnp.concatenate([x["kread"], x["v3"]], axis=2),
                     axis=2, keepdims=True))  # [hb, C, 1]
  dr_w = dr[:, :, :kd] * beta
  dv = dr[:, :, kd:] * beta
  dqr, dkr, dkcs = _scores_backward(x, d_aqk, da * beta, nb, p.scores)
  rowf3 = kh(f["rowf"])
  dq = d_qread * read3 + dqr * rowf3
  dk = d_kend * to_end3 + dr_w * read3 + dkr * rowf3
  dk = _add_column_factored(dk, dkcs, f["colfs"], hb, kd)
  d = dict(read=_lanes(d_qread * q3 + dr_w * k3),
           to_end=_lanes(d_kend * k3),
           total=_lanes(d_total),
           rowf=_lanes(dqr * q3 + dkr * k3),
           colfs=[_lanes(dkc * k3[:, :dkc.shape[1]]) for dkc in dkcs])
  # Padding's g and beta were set to 0: no gradient reaches them.
  dg = _unpadded(_factors_backward(f, d, c, nb), seg["keep"])
  _write_gradients(r, (dq, dk, dv, dg, _rows(dbeta, seg["keep"])), rate,
                   saved, t)

  _write_initial_cotangent(r, t, step)


def _write_initial_cotangent(r, t: Config, step):
  """dX into the initial state's block: at each run's first chunk with
  `t.run_states`, else at chunk 0 (the backward's last step)."""
  if t.run_states:  # the run's block holds dX at its first chunk
    r["ds0"][...] = r["dstate"][...]
  else:
    @pl.when(step == pl.num_programs(1) - 1)  # chunk 0: dX is the initial's
    def _():
      r["ds0"][...] = r["dstate"][...]


def _add_column_factored(dk, dkcs, colfs, hb, kd):
  """dk [hb, C, K] plus each block's d(k colf_n) * colf_n, on the rows up to
  block n's end only (`_scores_backward`'s dkcs[n] has just those)."""
  c = dk.shape[1]
  for dkc, colf in zip(dkcs, colfs):
    end = dkc.shape[1]
    head = dk[:, :end] + dkc * _heads(colf[:end], hb, kd)
    dk = head if end == c else jnp.concatenate([head, dk[:, end:]], axis=1)
  return dk


def _backward_step_start(r, t: Config, step, flags):
  """Before a backward step: at the last chunk (the first step) dX' is the
  final state's cotangent and the a_log and dt_bias sums start; with
  `t.run_states`, at each run's last chunk dX' is that run's final-state
  cotangent; with `t.boundary_chunks`, at a boundary's chunk the boundary
  state's cotangent is added to it."""
  dstate_ref = r["dstate"]

  @pl.when(step == 0)
  def _():
    dstate_ref[...] = r["dsf"][...].astype(_F32)
    if t.gated:
      r["da"][...] = jnp.zeros(r["da"].shape, _F32)
      r["ddt"][...] = jnp.zeros(r["ddt"].shape, _F32)

  if t.run_states:
    @pl.when(flags >= 2)
    def _():
      dstate_ref[...] = r["dsf"][...].astype(_F32)

  if t.boundary_chunks:  # dX' also takes the boundary state's cotangent
    @pl.when(_at_boundary(pl.num_programs(1) - 1 - step, t))
    def _():
      dstate_ref[...] += r["dbs"][...]


def _write_gradients(r, grads, rate, saved, t: Config):
  """Writes one block's gradients (dq, dk, dv [hb, C, *], dg [C, hb*K],
  dbeta columns); with `t.prep` pulled back through the preparation first,
  the a_log and dt_bias terms added to their resident sums."""
  dq, dk, dv, dg, dbeta = grads
  if t.prep is not None:
    dq, dk, dg, da, ddt = _prepare_block_backward(dq, dk, dg, rate, saved, t)
    if t.gated:
      r["da"][...] += da
      r["ddt"][...] += ddt
  rows = r.get("rows")
  _write(r["dq"], _lanes(dq), t, rows)
  _write(r["dk"], _lanes(dk), t, rows)
  _write(r["dv"], _lanes(dv), t, rows)
  _write(r["dg"], dg, t, rows)
  _write_beta(r["db"], dbeta, t)


def _heads_per_block(h, heads_per_block, strided=False):
  if strided:
    if heads_per_block not in (None, h):
      raise NotImplementedError(
          f"pallas_batched reads every head a step when strided; got"
          f" heads_per_block={heads_per_block}, H={h}.")
    return h
  if heads_per_block is None:
    return max(d for d in range(1, min(h, DEFAULT_HEADS_PER_BLOCK) + 1)
               if h % d == 0)
  if heads_per_block < 1 or h % heads_per_block:
    raise NotImplementedError(
        f"pallas_batched needs heads_per_block to divide H; got"
        f" heads_per_block={heads_per_block}, H={h}.")
  return heads_per_block


def vmem_bytes(t: Config, in_dtype, g_dtype) -> int:
  """A VMEM estimate: double-buffered blocks, the state, live values."""
  c, hb, kd, vd = t.chunk, t.heads_per_block, t.key_dim, t.value_dim
  isz = jnp.dtype(in_dtype).itemsize
  blocks = c * hb * (3 * kd * isz + vd * isz + kd * jnp.dtype(g_dtype).itemsize
                     + 4 * 8) + 8 * max(c, 128) * 4 * hb
  states = hb * kd * vd * 4 * (2 + (2 if t.has_initial_state else 0) + 1
                               + (2 if t.boundary_chunks else 0))
  live = 24 * hb * c * max(kd + vd, 128) * 4
  rows = c * hb * vd * 4 if _rows_scratch(t, in_dtype) else 0
  return 2 * blocks + states + live + rows


def _rows_scratch(t: Config, *dtypes) -> bool:
  """Whether a strided kernel writing blocks of `dtypes` takes a float32
  scratch of C*hb rows (`_write`): Mosaic has no strided store of 16-bit
  data (on a v5e: "Strided store with non 32-bit data"), so each head's
  rows go to the float32 block by strided stores, and the block, cast, to
  the 16-bit output by one contiguous store."""
  return t.strided and any(jnp.dtype(d).itemsize < 4 for d in dtypes)


def kda_forward(q, k, v, g, beta, initial_state=None, *, precision,
                chunk=pallas_tpu.DEFAULT_CHUNK, heads_per_block=None,
                lower_bound=None, strided=False, interpret=False):
  """The KDA forward on prepared inputs: (o [B,T,H,V], final [B,H,K,V] f32).

  Arguments as `pallas_tpu.kda_forward` (without segment_ids); default
  heads_per_block is the largest divisor of H up to 8. `strided`: read and
  write the op's [B, T, H, *] layout as rows with strided loads, all H
  heads a grid step (see `Config.strided`).
  """
  if not isinstance(precision, Precisions):
    raise ValueError(f"precision must be a Precisions; got {precision!r}.")
  _check_raw(q, k, v, g, beta, initial_state, chunk=chunk,
             lower_bound=lower_bound, gated=False, interpret=interpret)
  b, _, h, kd = q.shape
  t = Config(chunk=chunk,
             heads_per_block=_heads_per_block(h, heads_per_block, strided),
             key_dim=kd, value_dim=v.shape[-1],
             has_initial_state=initial_state is not None,
             precision=precision, interpret=bool(interpret),
             strided=bool(strided))
  return _kda(t, q, k, v, g, beta, initial_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(t: Config, q, k, v, g, beta, initial_state):
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


def kda(q, k, v, g, beta, initial_state=None, *, scale, a_log=None,
        dt_bias=None, lower_bound=None, use_gate_in_kernel=False,
        use_qk_l2norm=False, precision, chunk=pallas_tpu.DEFAULT_CHUNK,
        heads_per_block=None, strided=False, strided_backward=None,
        strided_primal=False, fused_backward=True, segment_ids=None,
        num_segments=None, chunk_states_every=None, interpret=False):
  """The KDA forward on the op's raw inputs, preparation inside the kernel.

  q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], initial_state
  [B, H, K, V] or None; the gate fused (`use_gate_in_kernel`) only with
  `lower_bound` in [-5, 0) (the kernel's exponent factors need every log
  decay >= -5), else g is the log decay (>= -5). The forward kernel
  normalises q and k, scales q and activates the gate on each block, so no
  prepared copy of q, k or g is written to HBM. The backward kernel
  prepares each block and pulls back itself (`Config.fused_backward`): no
  prepared copy, no float32 gradient of q, k or g goes through HBM; with
  `fused_backward=False` the backward prepares them in XLA, runs the
  backward kernel and pulls the gradients back through the preparation.

  `segment_ids` [B, T] (1-indexed, 0 = padding; the op's segment
  semantics, `common`) packs sequences for training: each chunk restricts
  its pairs and its reads and writes of the carried state to runs
  (`_run_masks`); no initial state is taken and no final state returned.
  With `num_segments` N as well, the states are per segment: initial_state
  [B, N, H, K, V] (or None: zeros), and the final states [B, N, H, K, V]
  are returned. Each run is then moved to start on a chunk edge
  (`_realign`), so a row takes at most N runs (a segment met again after
  another starts one more); a row with more, or with an id above N, gets
  NaN outputs and states (backend `pallas` runs such calls on `chunked`,
  `too_many_runs`). The grid always covers the bound, T + N (C - 1) tokens
  rounded up to the chunk, whatever the rows hold.

  `strided` reads and writes the op's layout as rows, all H heads a step
  (`Config.strided`); `strided_backward` (None: as `strided`) False with
  it runs the fused backward on unstrided blocks of `heads_per_block`
  heads (None: the default) instead. `strided_primal` (without `strided`
  and packed segments): a call that is not differentiated runs the strided
  forward, a differentiated one the unstrided forward and backward of
  `heads_per_block` heads (on a v5e the strided forward is the faster
  forward, the unstrided pair the faster forward+backward; docs/kernel.md).

  `chunk_states_every` C (a multiple of `chunk`; not with `num_segments`):
  also the states after tokens C, 2 C, ... (the op's chunk-boundary
  states), from the same pass: the forward kernel writes its carried state
  out at every C-th token and the backward kernel adds their cotangents to
  the carried state's there. With `segment_ids` the carried state there is
  that of the segment holding the boundary token (the caller zeros those
  at padding).

  Returns (o [B, T, H, V] in q's dtype, final state float32: [B, H, K, V],
  or [B, N, H, K, V] with `num_segments`, or None with `segment_ids` only);
  with `chunk_states_every`, a third element [B, T // C, H, K, V] float32.
  """
  if not isinstance(precision, Precisions):
    raise ValueError(f"precision must be a Precisions; got {precision!r}.")
  if use_gate_in_kernel and lower_bound is None:
    raise NotImplementedError(
        "pallas_batched fuses only the lower-bound gate (lower_bound in"
        " [-5, 0)); the softplus gate's log decays have no lower bound.")
  gated = bool(use_gate_in_kernel)
  if gated and (a_log is None or dt_bias is None):
    raise ValueError("use_gate_in_kernel needs a_log [H] and dt_bias [H*K].")
  # Per-segment states are checked with the segments.
  _check_raw(q, k, v, g, beta,
             initial_state if num_segments is None else None, chunk=chunk,
             lower_bound=lower_bound, gated=gated, interpret=interpret)
  b, seq, h, kd = q.shape
  if segment_ids is not None:
    _check_segments(segment_ids, (b, seq), initial_state, strided,
                    num_segments, (b, h, kd, v.shape[-1]))
  elif num_segments is not None:
    raise ValueError("num_segments is for packed segments; got no"
                     " segment_ids.")
  run_states = int(num_segments or 0) if segment_ids is not None else 0
  prep = Prep(l2norm=bool(use_qk_l2norm), scale=float(scale),
              lower_bound=float(lower_bound) if gated else None)
  split = bool(strided) and strided_backward is not None and (
      not strided_backward)
  if split and not fused_backward:
    raise NotImplementedError(
        "pallas_batched runs an unstrided backward after a strided forward"
        " only in its fused form; got strided_backward=False with"
        " fused_backward=False.")
  t = Config(chunk=chunk,
             heads_per_block=_heads_per_block(
                 h, None if split else heads_per_block, strided),
             key_dim=kd, value_dim=v.shape[-1],
             has_initial_state=initial_state is not None or run_states > 0,
             precision=precision, interpret=bool(interpret), prep=prep,
             strided=bool(strided), fused_backward=bool(fused_backward),
             backward_heads_per_block=(
                 _heads_per_block(h, heads_per_block) if split else None),
             segmented=segment_ids is not None, run_states=run_states)
  if strided_primal:
    if strided or segment_ids is not None:
      raise NotImplementedError(
          "pallas_batched's strided_primal runs the strided forward for"
          " calls that are not differentiated: it takes no packed segments"
          " (strided reads have none) and is not for strided=True; got"
          f" strided={strided}, packed segments: {segment_ids is not None}.")
    t = dataclasses.replace(t, primal=dataclasses.replace(
        t, strided=True, heads_per_block=_heads_per_block(h, None, True)))
  if not gated:
    a_log = dt_bias = None
  if chunk_states_every is not None:
    t = _with_boundaries(t, chunk_states_every, seq)
  if run_states:
    return _kda_runs(t, q, k, v, g, beta, initial_state, a_log, dt_bias,
                     segment_ids)
  o, final, *bounds = _kda_raw(t, q, k, v, g, beta, initial_state, a_log,
                               dt_bias, segment_ids)
  if chunk_states_every is not None and not bounds:  # none inside T
    bounds = [jnp.zeros((b, 0, h, kd, v.shape[-1]), _F32)]
  return (o, None if t.segmented else final, *bounds)


def _with_boundaries(t: Config, every, seq) -> Config:
  """`t` writing the state after every `every` tokens (`Config.boundaries`;
  its `primal` too)."""
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise ValueError(
        f"chunk_states_every must be an int >= 1; got {every!r}.")
  if every % t.chunk:
    raise NotImplementedError(
        f"pallas_batched writes chunk-boundary states at chunk edges:"
        f" chunk_states_every must be a multiple of the chunk ({t.chunk});"
        f" got {every}.")
  if t.run_states:
    raise NotImplementedError(
        "pallas_batched writes chunk-boundary states without per-segment"
        " states only (their layout moves runs off the boundaries); got"
        f" num_segments={t.run_states}.")
  fields = dict(boundary_chunks=every // t.chunk, boundaries=seq // every)
  if not fields["boundaries"]:
    return t
  primal = t.primal and dataclasses.replace(t.primal, **fields)
  return dataclasses.replace(t, primal=primal, **fields)


def too_many_runs(segment_ids, num_segments):
  """[B] bool: the rows `kda` cannot lay out with per-segment states: more
  runs than `num_segments`, or an id above it."""
  ids = segment_ids.astype(jnp.int32)
  run_seg, _, start = common.segment_runs(ids)
  return _beyond(ids, start & (run_seg > 0), num_segments, num_segments)


def _beyond(ids, first, runs, num_segments):
  """[B] bool: rows with more than `runs` runs (`first`: where each starts)
  or an id above `num_segments`."""
  return (jnp.sum(first, axis=1) > runs) | jnp.any(ids > num_segments, axis=1)


def _realign(segment_ids, runs, num_segments, c):
  """The layout in which every run starts on a chunk edge.

  Each run (`common.segment_runs`; the padding after a token joins its run,
  the padding before a row's first token is dropped) keeps its tokens in
  order from a chunk edge, and its last chunk is filled with padding. With
  at most `runs` runs a row the length is at most T + runs (C - 1), rounded
  up to the chunk: T'. Returns a dict of
    src [B, T'] (the token each place holds), valid [B, T'] (1: a token, 0:
    padding), place [B, T] (each token's place; T' for none), chunk_run and
    flags [B, T'/C] (each chunk's run; 1 a run starts there, 2 one ends
    there), run_segment [B, R] (its segment id, 0 for no run), last_run [B,
    N] (each segment's last run, -1 for none) and over [B] (a row with more
    than `runs` runs, or an id above `num_segments`).
  """
  b, seq = segment_ids.shape
  n = -(-(seq + runs * (c - 1)) // c)
  tp = n * c
  ids = segment_ids.astype(jnp.int32)
  run_seg, _, start = common.segment_runs(ids)
  real = run_seg > 0
  first = start & real
  run = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
  count = run[:, -1] + 1
  kept = real & (run < runs)
  slot = jnp.where(kept, run, runs)  # `runs`: a slot that is dropped
  rows = jnp.arange(b)[:, None]
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
  length = jnp.zeros((b, runs + 1), jnp.int32).at[rows, slot].add(1)
  begin = jnp.full((b, runs + 1), seq, jnp.int32).at[rows, slot].min(pos)
  span = -(-length[:, :runs] // c) * c
  edge = jnp.cumsum(span, axis=1) - span
  edge_t = jnp.take_along_axis(jnp.pad(edge, [(0, 0), (0, 1)]), slot, axis=1)
  begin_t = jnp.take_along_axis(begin, slot, axis=1)
  place = jnp.where(kept, edge_t + pos - begin_t, tp)
  src = jnp.zeros((b, tp), jnp.int32).at[rows, place].set(pos, mode="drop")
  valid = jnp.zeros((b, tp), jnp.int32).at[rows, place].set(
      (ids > 0).astype(jnp.int32), mode="drop")
  live = jnp.arange(runs)[None] < jnp.minimum(count, runs)[:, None]
  starts = jnp.zeros((b, n + 1), jnp.int32).at[
      rows, jnp.where(live, edge // c, n)].set(1, mode="drop")[:, :n]
  chunk_run = jnp.maximum(jnp.cumsum(starts, axis=1) - 1, 0)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones((b, 1), jnp.int32)], axis=1)
  run_segment = jnp.zeros((b, runs + 1), jnp.int32).at[rows, slot].max(
      run_seg)[:, :runs]
  last_run = jnp.full((b, num_segments), -1, jnp.int32).at[
      rows, jnp.where(kept, run_seg - 1, num_segments)].max(run, mode="drop")
  return dict(src=src, valid=valid, place=place, chunk_run=chunk_run,
              flags=starts + 2 * ends, run_segment=run_segment,
              last_run=last_run,
              over=_beyond(ids, first, runs, num_segments))


def _kda_runs(t: Config, q, k, v, g, beta, initial_state, a_log, dt_bias,
              segment_ids):
  """`kda` with per-segment states: in `_realign`'s layout, the kernels
  start each run from its segment's initial state and leave its final
  state in the run's block; XLA gathers the inputs there and the outputs
  and final states back."""
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  runs = t.run_states
  lay = _realign(segment_ids, runs, runs, t.chunk)
  pick = jax.vmap(lambda x, i: x[i])  # x[b][i[b]], for each batch row b
  valid = lay["valid"] > 0

  def gather(x):  # [B, T, ...] -> [B, T', ...]; 0 at padding's places
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, pick(x, lay["src"]), jnp.zeros((), x.dtype))

  if initial_state is None:
    initial_state = jnp.zeros((b, runs, h, kd, vd), _F32)
  s0 = initial_state.astype(_F32)
  has_seg = (lay["run_segment"] > 0)[:, :, None, None, None]
  s0_runs = jnp.where(has_seg, pick(s0, jnp.maximum(lay["run_segment"] - 1,
                                                   0)), 0.0)
  o, finals = _kda_raw(t, gather(q), gather(k), gather(v), gather(g),
                       gather(beta), s0_runs, a_log, dt_bias,
                       (lay["valid"], lay["chunk_run"], lay["flags"]))
  tp = lay["src"].shape[1]
  o = jnp.where((lay["place"] < tp)[:, :, None, None],
                pick(o, jnp.minimum(lay["place"], tp - 1)), 0.0).astype(q.dtype)
  seen = (lay["last_run"] >= 0)[:, :, None, None, None]
  final = jnp.where(seen, pick(finals, jnp.maximum(lay["last_run"], 0)), s0)
  over = lay["over"]
  o = jnp.where(over[:, None, None, None], jnp.nan, o).astype(q.dtype)
  final = jnp.where(over[:, None, None, None, None], jnp.nan, final)
  return o, final


def _check_segments(segment_ids, shape, initial_state, strided, num_segments,
                    heads):
  """The kernels' limits on packed segments (and their shape)."""
  if tuple(segment_ids.shape) != shape or not jnp.issubdtype(
      segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be integers of shape [B, T] = {shape};"
                     f" got {segment_ids.dtype} {tuple(segment_ids.shape)}.")
  if num_segments is None:
    if initial_state is not None:
      raise ValueError(
          "initial_state with segment_ids is per segment: pass num_segments"
          " N and initial_state [B, N, H, K, V].")
  elif not isinstance(num_segments, int) or num_segments < 1:
    raise ValueError(f"num_segments must be an int >= 1; got {num_segments!r}.")
  elif initial_state is not None:
    b, h, kd, vd = heads
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"initial_state must be floating point; got"
                       f" {initial_state.dtype}.")
    want = (b, num_segments, h, kd, vd)
    if tuple(initial_state.shape) != want:
      raise ValueError(f"initial_state with num_segments must have shape"
                       f" [B, N, H, K, V] = {want}; got"
                       f" {tuple(initial_state.shape)}.")
  if strided:
    raise NotImplementedError(
        "pallas_batched reads packed segments in its blocked layout only;"
        " got strided=True.")


def _check_raw(q, k, v, g, beta, initial_state, *, chunk, lower_bound, gated,
               interpret):
  """`pallas_tpu._check`'s limits (g the gate's input when `gated`)."""
  pallas_tpu._check(q, k, v, g, beta, initial_state, chunk=chunk,
                    lower_bound=lower_bound, segment_ids=None,
                    interpret=interpret, raw_gate=gated)
  nb = chunk // SUB
  if nb & (nb - 1):
    raise NotImplementedError(
        f"pallas_batched needs chunk / 16 to be a power of two; got"
        f" chunk={chunk}.")


def _prepared(t: Config, q, k, g, a_log, dt_bias):
  """The preparation the forward kernel does, in XLA (for the backward)."""
  prep = t.prep
  dtype = q.dtype
  if prep.l2norm:
    q = gates.l2_normalize(q, dtype=_F32)
    k = gates.l2_normalize(k, dtype=_F32)
  q = q.astype(_F32) * prep.scale
  if prep.lower_bound is not None:
    g = gates.kda_log_decay(g, a_log, dt_bias, prep.lower_bound, dtype=_F32)
  return q.astype(dtype), k.astype(dtype), g.astype(_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_raw(t: Config, q, k, v, g, beta, initial_state, a_log, dt_bias,
             segment_ids):
  return _forward(t.primal or t, q, k, v, g, beta, initial_state, a_log,
                  dt_bias, segment_ids)


def _kda_raw_fwd(t, q, k, v, g, beta, initial_state, a_log, dt_bias,
                 segment_ids):
  o, final, states, *bounds = _forward(
      dataclasses.replace(t, save_states=True), q, k, v, g, beta,
      initial_state, a_log, dt_bias, segment_ids)
  return (o, final, *bounds), (q, k, v, g, beta, initial_state, a_log,
                               dt_bias, segment_ids, states)


def _backward_config(t: Config) -> Config:
  """The backward's configuration: `t`, or with a strided forward and
  `t.backward_heads_per_block` the unstrided one of that many heads a
  step."""
  if not t.strided or t.backward_heads_per_block is None:
    return t
  return dataclasses.replace(t, strided=False,
                             heads_per_block=t.backward_heads_per_block,
                             backward_heads_per_block=None)


def _kda_raw_bwd(t, residuals, cotangents):
  (q, k, v, g, beta, initial_state, a_log, dt_bias, segment_ids,
   states) = residuals
  t = _backward_config(t)
  do, dfinal, *dbounds = cotangents  # the boundary states' with them
  dbounds = dbounds[0] if dbounds else None
  cast = lambda x, like: None if like is None else x.astype(like.dtype)
  if t.fused_backward:
    dq, dk, dv, dg, dbeta, ds0, da, ddt = _backward(
        t, q, k, v, g, beta, states, do, dfinal, a_log, dt_bias, segment_ids,
        dbounds)
    return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dg, g),
            cast(dbeta, beta), cast(ds0, initial_state), cast(da, a_log),
            cast(ddt, dt_bias), None)
  (qp, kp, gp), pull = jax.vjp(
      lambda q, k, g, a, d: _prepared(t, q, k, g, a, d), q, k, g, a_log,
      dt_bias)
  bare = dataclasses.replace(t, prep=None)
  dqp, dkp, dv, dgp, dbeta, ds0 = _backward(
      bare, qp, kp, v, gp, beta, states, do, dfinal, segment_ids=segment_ids,
      dbounds=dbounds)
  dq, dk, dg, da, ddt = pull((dqp.astype(qp.dtype), dkp.astype(kp.dtype),
                              dgp))
  return (cast(dq, q), cast(dk, k), cast(dv, v), cast(dg, g),
          cast(dbeta, beta), cast(ds0, initial_state), cast(da, a_log),
          cast(ddt, dt_bias), None)


_kda_raw.defvjp(_kda_raw_fwd, _kda_raw_bwd)


def _specs(t: Config, b, seq, h, *, reverse=False):
  """(n chunks, padded T, block specs, views) shared by forward and backward.

  `views` turn the op's arrays into what the blocks index: tok(x) for
  [B, T, H, d] tensors, beta(x) for [B, T, H], and back with untok.
  """
  c, hb, kd, vd = t.chunk, t.heads_per_block, t.key_dim, t.value_dim
  n = -(-seq // c)
  tp = n * c
  nh = h // hb
  at = (lambda j: n - 1 - j) if reverse else (lambda j: j)
  state = pl.BlockSpec((hb, kd, vd), lambda i, j, *_: (i, 0, 0))
  chunk_state = pl.BlockSpec((hb, pl.squeezed, kd, vd),
                             lambda i, j, *_: (i, at(j), 0, 0))
  lanes = pl.BlockSpec((1, hb * kd), lambda i, j, *_: (0, i % nh))
  # `t.run_states`: [B*R*H, K, V] states, the block of the chunk's run (the
  # first scalar-prefetched row).
  run_state = pl.BlockSpec(
      (hb, kd, vd), lambda i, j, run, *_: (
          (i // nh * t.run_states + run[i * n + at(j)]) * nh + i % nh, 0, 0))
  # Chunk-boundary states [B*H, P, K, V]: piece j // e's block, the tail
  # after the last boundary kept on the last one (so it is not revisited).
  e, last = t.boundary_chunks, t.boundaries - 1
  boundary = pl.BlockSpec(
      (hb, pl.squeezed, kd, vd),
      lambda i, j, *_: (i, jnp.minimum(at(j) // max(e, 1), last), 0, 0))
  runs = pl.BlockSpec((pl.squeezed, pl.squeezed, RUN_ROWS, c),
                      lambda i, j, *_: (i // nh, at(j), 0, 0))  # `_run_rows`
  if t.strided:  # rows (b, t, h) of [B*T*H, d]; all heads a step (nh = 1)
    tok = lambda d: pl.BlockSpec((c * h, d),
                                 lambda i, j, *_: (i * n + at(j), 0))
    rows = pl.BlockSpec((c, h), lambda i, j, *_: (i * n + at(j), 0))
    views = dict(tok=lambda x: x.reshape(b * tp * h, x.shape[-1]),
                 beta=lambda x: x.reshape(b * tp, h),
                 untok=lambda x, d: x.reshape(b, tp, h, d),
                 unbeta=lambda x: x.reshape(b, tp, h))
  else:
    tok = lambda d: pl.BlockSpec((pl.squeezed, c, hb * d),
                                 lambda i, j, *_: (i // nh, at(j), i % nh))
    rows = pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, hb, c),
                        lambda i, j, *_: (i // nh, at(j), i % nh, 0, 0))
    views = dict(
        tok=lambda x: x.reshape(b, tp, h * x.shape[-1]),
        beta=lambda x: pallas_tpu._beta_rows(x, n, c, nh, hb),
        untok=lambda x, d: x.reshape(b, tp, h, d),
        unbeta=lambda x: jnp.transpose(x.reshape(b, n, h, c),
                                       (0, 1, 3, 2)).reshape(b, tp, h))
  return n, tp, dict(tok=tok, rows=rows, state=state,
                     chunk_state=chunk_state, boundary=boundary, lanes=lanes,
                     runs=runs, run_state=run_state), views


def _gate_lanes(a_log, dt_bias, kd):
  """The fused gate's exp(a_log) per lane and dt_bias, as [1, H*K] rows."""
  h = a_log.shape[0]
  # `gates.exp`, as `gates.kda_log_decay` (the unfused path) takes it.
  rate = jnp.repeat(gates.exp(a_log.astype(_F32)), kd).reshape(1, h * kd)
  return [rate, dt_bias.astype(_F32).reshape(1, h * kd)]


def _params(budget):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary"),
      vmem_limit_bytes=int(min(max(32 * 2 ** 20, 2 * budget), 100 * 2 ** 20)))


def _chunk_inputs(t: Config, spec, view, n, nh, qkvgb, segment_ids, a_log,
                  dt_bias):
  """What both kernels read first, as (scalar-prefetched rows, in_specs,
  args, the state blocks' spec, states a batch row): q, k, v, g and beta
  blocks, with segments their run rows, with the fused gate its lanes
  (`_run_state_args` for the rest)."""
  q, k, v, g, beta = qkvgb
  kd, vd = t.key_dim, t.value_dim
  tok = spec["tok"]
  in_specs = [tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"]]
  args = [view["tok"](q), view["tok"](k), view["tok"](v), view["tok"](g),
          view["beta"](beta)]
  prefetch, state_spec, per_row = _run_state_args(t, segment_ids, spec, nh)
  if t.segmented:
    in_specs.append(spec["runs"])
    args.append(_run_rows(segment_ids[0] if t.run_states else segment_ids,
                          n, t.chunk, at_edges=bool(t.run_states)))
  if t.gated:
    in_specs += [spec["lanes"], spec["lanes"]]
    args += _gate_lanes(a_log, dt_bias, kd)
  return prefetch, in_specs, args, state_spec, per_row


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(t: Config, q, k, v, g, beta, initial_state, a_log=None,
             dt_bias=None, segment_ids=None):
  """(o, final state[, chunk states [B*H, T/C, K, V] with t.save_states]
  [, chunk-boundary states [B, P, H, K, V] with t.boundary_chunks]).

  With `t.prep`, q, k and g are raw (the kernel prepares them; a_log and
  dt_bias feed the fused gate); `segment_ids` [B, T] with `t.segmented`,
  and with `t.run_states` the triple (ids, runs, flags) of `_realign`
  (ids in its layout, T a multiple of the chunk): initial_state and the
  returned final state are then per run, [B, R, H, K, V].
  """
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  hb = t.heads_per_block
  n, tp, spec, view = _specs(t, b, seq, h)
  q, k, v, beta = pallas_tpu._pad_time(tp, q, k, v, beta)
  # Padding tokens must leave the state alone: k = v = beta = 0 there, and a
  # log decay of 0 (a raw gate of -inf through the fused gate's sigmoid).
  pad_g = -jnp.inf if t.gated else 0.0
  if tp != seq:
    g = jnp.pad(g, [(0, 0), (0, tp - seq), (0, 0), (0, 0)],
                constant_values=pad_g)
  tok = spec["tok"]
  prefetch, in_specs, args, state_spec, per_row = _chunk_inputs(
      t, spec, view, n, h // hb, (q, k, v, g, beta), segment_ids, a_log,
      dt_bias)
  if t.has_initial_state:
    in_specs.append(state_spec)
    args.append(initial_state.astype(_F32).reshape(-1, kd, vd))
  # Strided 16-bit output rows go through a float32 scratch
  # (`_rows_scratch`).
  o_dtype = q.dtype
  scratch = [pltpu.VMEM((hb, kd, vd), _F32)]
  if _rows_scratch(t, o_dtype):
    scratch.append(pltpu.VMEM((t.chunk * hb, vd), _F32))
  o_view = jax.eval_shape(view["tok"], jax.ShapeDtypeStruct(
      (b, tp, h, vd), o_dtype))
  out_specs = [tok(vd), state_spec]
  out_shape = [o_view,
               jax.ShapeDtypeStruct((b * per_row * h, kd, vd), _F32)]
  if t.save_states:
    out_specs.append(spec["chunk_state"])
    out_shape.append(jax.ShapeDtypeStruct((b * h, n, kd, vd), _F32))
  if t.boundary_chunks:
    out_specs.append(spec["boundary"])
    out_shape.append(jax.ShapeDtypeStruct((b * h, t.boundaries, kd, vd),
                                          _F32))
  out = pl.pallas_call(
      functools.partial(_kernel, t=t),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=(b * (h // hb), n),
          in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=_params(vmem_bytes(t, q.dtype, g.dtype)),
      interpret=t.interpret,
  )(*prefetch, *args)
  o = view["untok"](out[0], vd)[:, :seq].astype(q.dtype)
  final = out[1].reshape(b, -1, h, kd, vd)
  final = _mapped(final, segment_ids) if t.run_states else final[:, 0]
  extra = list(out[2:])
  if t.boundary_chunks:  # [B*H, P, K, V] -> [B, P, H, K, V]
    extra[-1] = jnp.moveaxis(extra[-1].reshape(b, h, -1, kd, vd), 1, 2)
  return (o, final, *extra)


def _mapped(states, segment_ids):
  """Per-run states [B, R, H, K, V] with 0 for the runs no chunk holds (no
  grid step writes their blocks)."""
  runs = segment_ids[1]
  live = jnp.any(runs[:, None, :] == jnp.arange(states.shape[1])[:, None],
                 axis=2)
  return jnp.where(live[:, :, None, None, None], states, 0.0)


def _run_state_args(t: Config, segment_ids, spec, nh):
  """(scalar-prefetched rows, the state blocks' spec, states a batch row):
  with `t.run_states` each chunk's run and flags, repeated for each of the
  nh head blocks of a batch row (a grid row reads its own), and a state per
  run; else no rows and one state a batch row."""
  if not t.run_states:
    return [], spec["state"], 1
  _, runs, flags = segment_ids
  rows = [jnp.repeat(x.astype(jnp.int32)[:, None], nh, axis=1).reshape(-1)
          for x in (runs, flags)]
  return rows, spec["run_state"], t.run_states


@functools.partial(jax.jit, static_argnums=(0,))
def _backward(t: Config, q, k, v, g, beta, states, do, dfinal, a_log=None,
              dt_bias=None, segment_ids=None, dbounds=None):
  """(dq, dk, dv, dg, dbeta, d initial state[, d a_log, d dt_bias]).

  `dbounds` [B, P, H, K, V]: the chunk-boundary states' cotangents (with
  `t.boundary_chunks`).

  Without `t.prep`, on prepared inputs, the gradients in float32. With it
  (the fused backward), on the raw inputs as `_forward` takes them: the
  gradients of q, k, v and g in their dtypes (strided 16-bit rows through
  a float32 scratch, `_rows_scratch`), and with the fused gate also those
  of a_log [H] and dt_bias [H*K], float32.
  """
  b, seq, h, kd = q.shape
  vd = v.shape[-1]
  hb = t.heads_per_block
  n, tp, spec, view = _specs(t, b, seq, h, reverse=True)
  # Padding (k = v = beta = 0, dO = 0, a log decay of 0: g = 0, or a raw
  # gate of -inf through the fused gate) adds nothing to any gradient.
  q, k, v, beta, do = pallas_tpu._pad_time(tp, q, k, v, beta, do)
  if tp != seq:
    g = jnp.pad(g, [(0, 0), (0, tp - seq), (0, 0), (0, 0)],
                constant_values=-jnp.inf if t.gated else 0.0)
  tok = spec["tok"]
  prefetch, in_specs, args, state_spec, per_row = _chunk_inputs(
      t, spec, view, n, h // hb, (q, k, v, g, beta), segment_ids, a_log,
      dt_bias)
  in_specs += [spec["chunk_state"], tok(vd), state_spec]
  args += [states, view["tok"](do), dfinal.astype(_F32).reshape(-1, kd, vd)]
  if t.boundary_chunks:  # [B, P, H, K, V] -> [B*H, P, K, V]
    in_specs.append(spec["boundary"])
    args.append(jnp.moveaxis(dbounds.astype(_F32), 2, 1).reshape(
        b * h, t.boundaries, kd, vd))
  dtype = lambda x: _F32 if t.prep is None else x.dtype
  shape = lambda d, x: jax.eval_shape(
      view["tok"], jax.ShapeDtypeStruct((b, tp, h, d), dtype(x)))
  db_shape = jax.eval_shape(view["beta"],
                            jax.ShapeDtypeStruct((b, tp, h), _F32))
  out_specs = [tok(kd), tok(kd), tok(vd), tok(kd), spec["rows"], state_spec]
  out_shape = [shape(kd, q), shape(kd, k), shape(vd, v), shape(kd, g),
               db_shape, jax.ShapeDtypeStruct((b * per_row * h, kd, vd), _F32)]
  scratch = [pltpu.VMEM((hb, kd, vd), _F32)]
  if _rows_scratch(t, *(s.dtype for s in out_shape[:4])):
    scratch.append(pltpu.VMEM((t.chunk * hb, max(kd, vd)), _F32))
  if t.gated:  # per-lane sums, resident along the (arbitrary) chunk axis
    nh = h // hb
    sums = pl.BlockSpec((pl.squeezed, 1, hb * kd),
                        lambda i, j, *_: (i // nh, 0, i % nh))
    out_specs += [sums, sums]
    out_shape += [jax.ShapeDtypeStruct((b, 1, h * kd), _F32)] * 2
  out = pl.pallas_call(
      functools.partial(_backward_kernel, t=t),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=(b * (h // hb), n),
          in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=_params(2 * vmem_bytes(t, q.dtype, g.dtype)),
      interpret=t.interpret,
  )(*prefetch, *args)
  dq, dk, dv, dg, db, ds0 = out[:6]
  unflat = lambda x, d: view["untok"](x, d)[:, :seq]
  ds0 = (_mapped(ds0.reshape(b, -1, h, kd, vd), segment_ids) if t.run_states
         else ds0.reshape(b, h, kd, vd))
  grads = (unflat(dq, kd), unflat(dk, kd), unflat(dv, vd), unflat(dg, kd),
           view["unbeta"](db)[:, :seq], ds0)
  if t.prep is None:
    return grads
  if not t.gated:
    return (*grads, None, None)
  da, ddt = out[6:]
  return (*grads, jnp.sum(da.reshape(b, h, kd), axis=(0, 2)),
          jnp.sum(ddt, axis=(0, 1)))
