"""CompressedSparseIndexer against a float64 NumPy re-implementation.

The oracle reads the module's parameters and recomputes, loop by loop, the
DeepSeek-V4 compressor (2r-token overlapping windows, per-channel softmax
with a position bias, block 0's missing half at kv = 0 / gate = -inf),
RMSNorm, interleaved RoPE, the query and weight projections, the score
(tests/ops/test_csa.py's oracle) and top-k with -1 for missing blocks.
"""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import modules
from linear_attention import testing
from tests.ops.test_csa import oracle as score_oracle

F32_RTOL = testing.RTOL[np.dtype("float32")]
CFG = dict(num_heads=3, head_dim=16, compress_rate=2, topk=4, rope_dim=8)


def param(params, suffix, name):
  (mod,) = [m for m in params if m.endswith(suffix)]
  return np.asarray(params[mod][name], np.float64)


def np_rope(x, pos, rope_dim, theta=10000.0):
  x = x.copy()
  c = x.shape[-1]
  for i in range(rope_dim // 2):
    ang = pos * theta ** (-2.0 * i / rope_dim)
    a, b = c - rope_dim + 2 * i, c - rope_dim + 2 * i + 1
    x0, x1 = x[..., a].copy(), x[..., b].copy()
    x[..., a] = x0 * np.cos(ang) - x1 * np.sin(ang)
    x[..., b] = x0 * np.sin(ang) + x1 * np.cos(ang)
  return x


def np_rmsnorm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_indexer(params, x, q_lowrank, *, num_heads, head_dim, compress_rate,
               topk, rope_dim, positions=None, segment_ids=None):
  x = np.asarray(x, np.float64)
  bsz, s, _ = x.shape
  h, d, r = num_heads, head_dim, compress_rate
  nw = s // r
  pos = np.broadcast_to(np.arange(s), (bsz, s)) if positions is None else \
      np.asarray(positions)
  kv = x @ param(params, "compressor_kv", "w")
  z = x @ param(params, "compressor_gate", "w")
  ape = param(params, "indexer", "compressor_ape")
  kc = np.zeros((bsz, nw, d))
  for b in range(bsz):
    for w in range(nw):
      own = range(w * r, (w + 1) * r)
      prev = range((w - 1) * r, w * r)
      use_prev = w > 0 and (segment_ids is None or segment_ids[b, w * r - 1]
                            == segment_ids[b, (w + 1) * r - 1])
      for c in range(d):
        logits = [z[b, t, d + c] + ape[t % r, d + c] for t in own]
        vals = [kv[b, t, d + c] for t in own]
        if use_prev:
          logits += [z[b, t, c] + ape[t % r, c] for t in prev]
          vals += [kv[b, t, c] for t in prev]
        p = np.exp(np.array(logits) - max(logits))
        kc[b, w, c] = np.dot(p / p.sum(), vals)
  kc = np_rmsnorm(kc, param(params, "compressor_norm", "scale"))
  kc = np_rope(kc, pos[:, 0:nw * r:r].astype(np.float64), rope_dim)
  q = (np.asarray(q_lowrank, np.float64) @ param(params, "q_b", "w"))
  q = np_rope(q.reshape(bsz, s, h, d), pos[:, :, None].astype(np.float64),
              rope_dim)
  wts = x @ param(params, "weights_proj", "w") * h**-0.5
  kseg = None if segment_ids is None else segment_ids[:, r - 1:nw * r:r]
  scores, mask = score_oracle(q, kc, wts, scale=d**-0.5, qpos=pos,
                              kpos=pos[:, r - 1:nw * r:r], qseg=segment_ids,
                              kseg=kseg)
  idx = -np.ones((bsz, s, topk), np.int64)
  for b in range(bsz):
    for t in range(s):
      vis = np.flatnonzero(mask[b, t])
      best = vis[np.argsort(-scores[b, t, vis], kind="stable")][:topk]
      idx[b, t, :len(best)] = best
  return idx, scores, kc, mask


def assert_topk_within_ties(indices, scores, ref, name):
  """`indices` [B, S, k] (best first, -1 after the visible blocks), the top-k
  of `scores`, pick the top-k of the reference scores `ref` up to ties.

  lax.top_k is exact on `scores`; with e = max |scores - ref| over a row's
  visible blocks, the j-th largest of the two rows differ by <= e (order
  statistics are 1-Lipschitz in the max norm), so ref at the j-th pick is
  within 2 e of ref's j-th largest. A pick that differs from ref's own order
  by more than that is a real error.
  """
  indices = np.asarray(indices)
  scores, ref = (np.asarray(x, np.float64) for x in (scores, ref))
  visible = np.isfinite(ref)
  # exact: -inf is written with jnp.where from integer positions/segments.
  np.testing.assert_array_equal(np.isfinite(scores), visible, err_msg=name)
  k = indices.shape[-1]
  for b, t in np.ndindex(indices.shape[:2]):
    vis = np.flatnonzero(visible[b, t])
    n = min(k, len(vis))
    picks = indices[b, t]
    assert np.all(picks[n:] == -1) and len(set(picks[:n])) == n, (
        name, b, t, picks)
    assert set(picks[:n]) <= set(vis), (name, b, t, picks, vis)
    if not n:
      continue
    e = np.abs(scores[b, t, vis] - ref[b, t, vis]).max()
    best = np.sort(ref[b, t, vis])[::-1][:n]
    off = np.abs(ref[b, t, picks[:n]] - best)
    assert np.all(off <= 2 * e), (name, b, t, picks, off, e)


def make(seed=0, b=2, s=13, m=12, q_rank=10, packed=False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(b, s, m)).astype(np.float32)
  ql = rng.normal(size=(b, s, q_rank)).astype(np.float32)
  kw = {}
  if packed:  # two documents per row, the cut on a multiple of r = 2
    seg = np.ones((b, s), np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    seg[:, 6:], pos[:, 6:] = 2, np.arange(s - 6)
    kw = dict(positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
  return jnp.asarray(x), jnp.asarray(ql), kw


def forward(cfg, **options):
  def f(x, ql, **kw):
    return modules.CompressedSparseIndexer(**cfg, **options, name="indexer")(
        x, ql, **kw)
  model = hk.without_apply_rng(hk.transform(f))
  return hk.Transformed(model.init, jax.jit(model.apply))


@pytest.mark.parametrize("packed", [False, True])
def test_matches_numpy_oracle(packed):
  x, ql, kw = make(seed=1, packed=packed)
  model = forward(CFG)
  params = model.init(jax.random.key(0), x, ql, **kw)
  # A non-zero position bias and norm scale, so both are exercised.
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda p: p, params)
  params["indexer"]["compressor_ape"] = jnp.asarray(
      rng.normal(size=params["indexer"]["compressor_ape"].shape), jnp.float32)
  (norm,) = [m for m in params if m.endswith("compressor_norm")]
  params[norm]["scale"] = jnp.asarray(
      rng.uniform(0.5, 1.5, size=(CFG["head_dim"],)), jnp.float32)
  out = model.apply(params, x, ql, **kw)
  chex.assert_shape(out.indices, (2, 13, CFG["topk"]))
  chex.assert_shape(out.k_compressed, (2, 6, CFG["head_dim"]))
  chex.assert_shape(out.scores, (2, 13, 6))
  np_kw = {k: np.asarray(v) for k, v in kw.items()}
  idx, scores, kc, mask = np_indexer(params, x, ql, **CFG, **np_kw)
  testing.assert_close(out.k_compressed, kc, rtol=F32_RTOL, name="k")
  got = np.asarray(out.scores)
  # exact: -inf is written with jnp.where from integer positions/segments.
  np.testing.assert_array_equal(np.isneginf(got), ~mask)
  testing.assert_close(got[mask], scores[mask], rtol=F32_RTOL, name="scores")
  # float32 indices against the float64 oracle's scores: equal up to ties.
  assert_topk_within_ties(out.indices, got, scores, "library vs oracle")
  assert (np.asarray(out.indices)[:, 0] == -1).all()  # token 0 sees nothing


def test_topk_equal_across_backends():
  x, ql, kw = make(seed=3, s=21, packed=True)
  cfg = dict(CFG, topk=8)  # more than some tokens can see: -1 slots
  params = forward(cfg).init(jax.random.key(1), x, ql, **kw)
  outs = {}
  for backend, opts in (("reference", {}), ("xla_chunked", dict(block_q=8)),
                        ("pallas", dict(block_q=8, interpret=True))):
    outs[backend] = forward(cfg, score_backend=backend, **opts).apply(
        params, x, ql, **kw)
  ref = np.asarray(outs["reference"].indices)
  ref_scores = np.asarray(outs["reference"].scores)
  visible = np.isfinite(ref_scores).sum(-1)
  # exact: integer counts of the -inf (jnp.where) entries.
  np.testing.assert_array_equal((ref == -1).sum(-1),
                                np.maximum(0, 8 - visible))
  # Three compiled programs: the same blocks up to ties within their
  # scores' float32 differences (assert_topk_within_ties), not bit for bit.
  for backend in ("reference", "xla_chunked", "pallas"):
    scores = np.asarray(outs[backend].scores)
    testing.assert_close(scores[np.isfinite(ref_scores)],
                         ref_scores[np.isfinite(ref_scores)], rtol=F32_RTOL,
                         name=f"{backend} scores")
    assert_topk_within_ties(outs[backend].indices, scores, ref_scores,
                            backend)


def test_causal_future_tokens_do_not_change_scores():
  x, ql, _ = make(seed=4, s=12)
  model = forward(CFG)
  params = model.init(jax.random.key(2), x, ql)
  t0 = 7
  x2 = x.at[:, t0:].add(3.0)
  ql2 = ql.at[:, t0:].add(3.0)
  a = np.asarray(model.apply(params, x, ql).scores)[:, :t0]
  b = np.asarray(model.apply(params, x2, ql2).scores)[:, :t0]
  # exact: the same compiled apply; the scores before t0 read only inputs
  # before t0 (later blocks are -inf by jnp.where), which are equal.
  np.testing.assert_array_equal(a, b)
  assert np.isfinite(a).any()
  # ...and they do change the later tokens' scores (the check can fail).
  c = np.asarray(model.apply(params, x2, ql2).scores)[:, t0:]
  assert not np.array_equal(np.asarray(model.apply(params, x, ql).scores)[
      :, t0:], c)


def test_query_from_x_and_gradients():
  x, _, _ = make(seed=5)
  model = hk.without_apply_rng(hk.transform(
      lambda x: modules.CompressedSparseIndexer(**CFG, q_rank=6)(x)))
  model = hk.Transformed(model.init, jax.jit(model.apply))
  params = model.init(jax.random.key(3), x)
  out = model.apply(params, x)
  chex.assert_shape(out.indices, (2, 13, CFG["topk"]))

  def loss(p):
    s = model.apply(p, x).scores
    return jnp.sum(jnp.where(jnp.isfinite(s), s, 0.0) ** 2)

  grads = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree.leaves(grads)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0


@pytest.mark.parametrize("q_rank,packed", [(6, False), (None, True)])
def test_gradients_match_float64_finite_differences_of_the_oracle(
    q_rank, packed):
  # Every parameter's and input's gradient (the q_rank path: q_a and its
  # norm included), along a random direction, against a central difference
  # of the float64 NumPy oracle: nothing of the library on the other side.
  x, ql, kw = make(seed=6, packed=packed)
  if q_rank is None:
    model = forward(CFG)
    inputs = dict(x=x, ql=ql)
    apply = lambda p, a: model.apply(p, a["x"], a["ql"], **kw)
  else:
    model = forward(dict(CFG, q_rank=q_rank))
    inputs = dict(x=x)
    apply = lambda p, a: model.apply(p, a["x"], None, **kw)
  params = _noisy(model.init(jax.random.key(4), x,
                             ql if q_rank is None else None, **kw))
  rng = np.random.default_rng(8)
  mask = np.isfinite(np.asarray(apply(params, inputs).scores))
  cot = np.where(mask, rng.normal(size=mask.shape), 0.0)

  def loss(p, a):
    s = apply(p, a).scores
    return jnp.sum(jnp.where(mask, s, 0.0) * cot)

  def np_loss(p, a):
    np_p = jax.tree.map(lambda v: np.asarray(v, np.float64), p)
    if q_rank is None:
      ql_np = a["ql"]
    else:
      ql_np = np_rmsnorm(np.asarray(a["x"], np.float64) @ param(
          np_p, "q_a", "w"), param(np_p, "q_a_norm", "scale"))
    np_kw = {k: np.asarray(v) for k, v in kw.items()}
    _, scores, _, m = np_indexer(np_p, a["x"], ql_np, **CFG, **np_kw)
    return float(np.sum(np.where(m, scores, 0.0) * cot))

  grads = jax.jit(jax.grad(loss, (0, 1)))(params, inputs)
  leaves = {**{("param",) + tuple(str(k) for k in path): v for path, v in
               jax.tree_util.tree_leaves_with_path(params)},
            **{("input", n): v for n, v in inputs.items()}}
  g_leaves = {**{("param",) + tuple(str(k) for k in path): v for path, v in
                 jax.tree_util.tree_leaves_with_path(grads[0])},
              **{("input", n): v for n, v in grads[1].items()}}
  assert {k[0] for k in leaves} == {"param", "input"}
  eps = 1e-6
  for key, value in leaves.items():
    u = rng.normal(size=value.shape)

    def moved(sign):
      shift = lambda v: np.asarray(v, np.float64) + sign * eps * u
      if key[0] == "input":
        return params, dict(inputs, **{key[1]: shift(inputs[key[1]])})
      p = jax.tree_util.tree_map_with_path(
          lambda path, v: shift(v) if ("param",) + tuple(
              str(k) for k in path) == key else v, params)
      return p, inputs

    numeric = (np_loss(*moved(1.0)) - np_loss(*moved(-1.0))) / (2 * eps)
    analytic = float(np.vdot(np.asarray(g_leaves[key], np.float64), u))
    # float32 gradients summed over every entry: 1e-4 of the largest term.
    assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), (
        key, analytic, numeric)


def _noisy(params, seed=5):
  """Initialised params plus noise (a non-zero position bias, norm scales
  away from 1), so that every parameter matters."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [
      p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def test_bad_arguments_raise_naming_them():
  for name, over in (("num_heads", dict(num_heads=0)),
                     ("compress_rate", dict(compress_rate=0)),
                     ("topk", dict(topk=0)),
                     ("rope_dim", dict(rope_dim=32)),
                     ("q_rank", dict(q_rank=0)),
                     ("backend", dict(score_backend="cuda"))):
    with pytest.raises(ValueError, match=name):
      hk.transform(lambda: modules.CompressedSparseIndexer(
          **{**CFG, **over})).init(None)
  x, ql, _ = make()

  def call(x, ql, **kw):
    return hk.transform(lambda: modules.CompressedSparseIndexer(**CFG)(
        x, ql, **kw)).init(jax.random.key(0))

  with pytest.raises(ValueError, match="q_rank"):
    call(x, None)
  with pytest.raises(ValueError, match="q_lowrank"):
    call(x, ql[:, :5])
  with pytest.raises(ValueError, match="x"):
    call(x[0], ql)
  with pytest.raises(ValueError, match="compress_rate"):
    call(x[:, :1], ql[:, :1])
  with pytest.raises(ValueError, match="positions"):
    call(x, ql, positions=jnp.zeros((2, 5), jnp.int32))
