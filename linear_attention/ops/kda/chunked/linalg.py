"""The linear-algebra kit of the chunked form, with closed-form VJPs.

Range sums and block sums as matmuls with 0/1 matrices, the masked exponent,
matmuls whose autodiff form is slow on CPU (`mm`, `mm_nt`), and the unit
lower-triangular solve of the UT transform on 16 x 16 blocks (`ut_solve`, its
VJP a back substitution). See `chunked/__init__.py` for the algebra.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.ops.kda import common


SUB = 16  # block size when the decays are unbounded (or bounded below -5)
HIGHEST = jax.lax.Precision.HIGHEST


def segmented_cumsum(x, starts, axis):
  """Cumulative sum along `axis` that restarts where `starts` is True."""

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return fa | fb, jnp.where(fb, vb, va + vb)

  starts = jnp.broadcast_to(starts, x.shape)
  return jax.lax.associative_scan(combine, (starts, x), axis=axis)[1]


def range_sums(x, size, relation):
  """y[i] = sum of x[j] over j in i's block of `size` with relation(i, j).

  Along axis -2 of x [..., S, K] (S a multiple of `size`). Each block is a
  matmul with a [size, size] 0/1 matrix: each output is the float32 sum of
  exactly its range (HIGHEST precision: no reduced-precision passes on
  GPU/TPU), and its transpose is another such matmul. On CPU this is several
  times faster than `lax.cumsum` (a quadratic reduce-window), and the scores
  come out more accurate than from `lax.associative_scan` sums (tested
  against float64: the a_log gradient's error halves at lower_bound=-2.5).
  The 0/1 matrix is broadcast over the blocks, so the product is a batched
  matmul whose output is already in x's layout, and the VJP multiplies by
  the transposed matrix the same way (autodiff would transpose the data).
  """
  i = np.arange(size)
  mask = relation(i[:, None], i[None, :]).astype(np.float32)
  shape = x.shape

  def apply(m, y):
    y3 = y.reshape((-1, size, shape[-1]))
    mb = jnp.broadcast_to(jnp.asarray(m, y.dtype), (y3.shape[0], size, size))
    out = jax.lax.dot_general(mb, y3, (((2,), (1,)), ((0,), (0,))),
                              precision=HIGHEST)
    return out.reshape(shape)

  @jax.custom_vjp
  def sums(y):
    return apply(mask, y)

  sums.defvjp(lambda y: (apply(mask, y), None),
              lambda _, g: (apply(mask.T, g),))
  return sums(x)


def pair_sums(x, size):
  """y[..., n, s, t, :] = sum of x over (t, s] in block n (0 where s <= t).

  x [..., S, K] in blocks of `size` along axis -2; y [..., S/size, size,
  size, K]. Like `range_sums`, one HIGHEST matmul per block with a
  [size * size, size] 0/1 matrix (its VJP the transposed matrix): every
  pair's exponent is the float32 sum of exactly its range, on any backend.
  (`lax.cumsum` here would be a reduce-window, whose arithmetic on an
  accelerator the op does not pin.)
  """
  i = np.arange(size)
  s, t, u = i[:, None, None], i[None, :, None], i[None, None, :]
  mask = ((t < u) & (u <= s)).astype(np.float32).reshape(size * size, size)
  shape = x.shape
  out_shape = shape[:-2] + (shape[-2] // size, size, size, shape[-1])

  def apply(m, y, rows, cols):
    y3 = y.reshape((-1, cols, shape[-1]))
    mb = jnp.broadcast_to(jnp.asarray(m, y.dtype), (y3.shape[0], rows, cols))
    return jax.lax.dot_general(mb, y3, (((2,), (1,)), ((0,), (0,))),
                               precision=HIGHEST)

  @jax.custom_vjp
  def sums(y):
    return apply(mask, y, size * size, size).reshape(out_shape)

  sums.defvjp(
      lambda y: (sums(y), None),
      lambda _, g: (apply(mask.T, g, size, size * size).reshape(shape),))
  return sums(x)


def transposed(x):
  """x with its last two axes swapped, as an array of its own."""
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _same_vma(f):
  """Calls f with its array arguments cast to the same mesh variance.

  Under `shard_map` (check_vma=True) a custom VJP's cotangents must have the
  variance of their primal inputs; with one input mesh-invariant (a constant,
  a replicated state) and the other varying, the closed-form cotangent of the
  invariant one would vary. Casting first lets autodiff transpose the cast
  (a psum) outside the custom rule. A no-op outside `shard_map`. The last
  argument, the precision, is static and passed through.
  """
  @functools.wraps(f)
  def call(*args):
    *arrays, precision = args
    return f(*common.vary_like(tuple(arrays), *arrays), precision)
  return call


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mm(a, b, precision):
  """a @ b for [..., M, K] x [..., K, N] with equal batch axes.

  Its VJP computes a^T g from a materialised a^T: autodiff's form contracts
  over a's major axis, which XLA:CPU sends to a dot path ~2x slower. Every
  product, the VJP's included, runs at `precision` (a `lax.Precision`).
  """
  return jnp.matmul(a, b, precision=precision)


mm = _same_vma(_mm)


def _mm_fwd(a, b, precision):
  return _mm(a, b, precision), (a, b)


def _mm_bwd(precision, res, g):
  a, b = res
  return (mm_nt(g, b, precision),
          jnp.matmul(transposed(a), g, precision=precision))


_mm.defvjp(_mm_fwd, _mm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mm_nt(a, b, precision):
  """a @ b^T for [..., M, K] x [..., N, K] with equal batch axes (see `mm`)."""
  return jnp.einsum("...ik,...jk->...ij", a, b, precision=precision)


mm_nt = _same_vma(_mm_nt)


def _mm_nt_fwd(a, b, precision):
  return _mm_nt(a, b, precision), (a, b)


def _mm_nt_bwd(precision, res, g):
  a, b = res
  return (jnp.matmul(g, b, precision=precision),
          jnp.matmul(transposed(g), a, precision=precision))


_mm_nt.defvjp(_mm_nt_fwd, _mm_nt_bwd)


def exp_masked(x, mask):
  """exp(x) where mask, else 0, without evaluating exp on masked entries."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def block_sums(tot, relation):
  """sum of whole-block totals tot [..., NB, K] over blocks l with relation.

  `relation(n, m, l)` is a boolean over block indices; the result is indexed
  [..., n, m, K] (use m = n for one-index relations). Multiplying by a 0/1
  mask and adding is exact, so these are true range sums.
  """
  nb = tot.shape[-2]
  i = jnp.arange(nb)
  mask = relation(i[:, None, None], i[None, :, None], i[None, None, :])
  return jnp.einsum("nml,...lk->...nmk", mask.astype(tot.dtype), tot,
                    precision=HIGHEST)


def to_blocks(full, size):
  """[..., C, C] -> [..., NB, NB, size, size] blocks (row block, col block)."""
  batch, c = full.shape[:-2], full.shape[-1]
  n = c // size
  return jnp.swapaxes(full.reshape(batch + (n, size, n, size)), -2, -3)


def unit_triangular_solve(blk, rhs, lower, precision):
  """(I + A)^-1 rhs for A strictly triangular, given as blocks.

  Args:
    blk: [..., NB, NB, S, S], blk[n, m] = A[n-th row block, m-th col block];
      A strictly lower (`lower`) or strictly upper.
    rhs: [..., NB * S, N].
    lower: whether A is lower triangular.
    precision: the `lax.Precision` of every product.

  Blocked substitution: the S x S diagonal blocks are inverted by repeated
  squaring (six batched matmuls), then the block rows are solved in order
  (from the top when lower, from the bottom when upper), each with two
  matmuls. XLA's batched triangular_solve on CPU is far slower for many
  small systems.
  """
  nb, s = blk.shape[-3], blk.shape[-1]
  batch = blk.shape[:-4]
  diag = jnp.stack([blk[..., i, i, :, :] for i in range(nb)], axis=-3)
  # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8): L is strictly
  # triangular 16 x 16, so L^16 = 0 and the product telescopes to
  # (I - L^16)(I + L)^-1.
  matmul = functools.partial(jnp.matmul, precision=precision)
  eye = jnp.eye(s, dtype=blk.dtype)
  inv = eye - diag
  power = diag
  for _ in range(s.bit_length() - 2):
    power = matmul(power, power)
    inv = matmul(inv, eye + power)
  rb = rhs.reshape(batch + (nb, s, rhs.shape[-1]))
  xs = [None] * nb
  for i in (range(nb) if lower else reversed(range(nb))):
    r = rb[..., i, :, :]
    done = range(i) if lower else range(i + 1, nb)
    if done:
      left = jnp.swapaxes(blk[..., i, done[0]:done[-1] + 1, :, :], -2, -3)
      r = r - matmul(left.reshape(batch + (s, len(done) * s)),
                     jnp.concatenate([xs[m] for m in done], axis=-2))
    xs[i] = matmul(inv[..., i, :, :], r)
  return jnp.concatenate(xs, axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ut_solve(a, rhs, precision):
  """(I + A)^-1 rhs for A [..., C, C] strictly lower, rhs [..., C, N].

  Blocked forward substitution on 16 x 16 blocks. The VJP is the closed form
  d rhs = (I + A)^-T g (back substitution with the transposed blocks) and
  dA = -tril(d rhs out^T) (strictly lower): no autodiff through the blocks.
  Every product at `precision`.
  """
  return unit_triangular_solve(to_blocks(a, SUB), rhs, lower=True,
                               precision=precision)


ut_solve = _same_vma(_ut_solve)


def _ut_solve_fwd(a, rhs, precision):
  out = _ut_solve(a, rhs, precision)
  return out, (a, out)


def _ut_solve_bwd(precision, res, g):
  a, out = res
  d_rhs = unit_triangular_solve(to_blocks(transposed(a), SUB), g,
                                lower=False, precision=precision)
  i = jnp.arange(a.shape[-1])
  d_a = jnp.where(i[:, None] > i[None, :], -mm_nt(d_rhs, out, precision),
                  0.0)
  return d_a, d_rhs



_ut_solve.defvjp(_ut_solve_fwd, _ut_solve_bwd)
