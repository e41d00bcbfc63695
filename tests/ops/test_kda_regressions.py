"""Regression tests named after failures that users of KDA kernels have hit.

Each test is named after the failure it prevents (reported against peer
implementations of this op: NaN gradients from exp overflow when only the
forward masks, log decays of exactly 0, padding rows poisoning gradients,
very short sequences, conv windows longer than a chunk or a rank, bf16
decays near 1 rounding to 1, decode drifting from the training forward).
Forward values are judged by the float64 NumPy recurrence
(`tests/kda_oracle.py`); gradients must be finite and match `reference`,
whose gradients `tests/ops/test_gradient_anchors.py` anchors to finite
differences.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention import testing
from linear_attention.modules import KimiDeltaAttention
from linear_attention.modules import kda as kda_module
from tests.kda_oracle import kda_numpy
from tests.ops.test_kda import loss_and_grads
from tests.parallel import common as cp_common

F32 = testing.RTOL[np.dtype("float32")]
BF16 = testing.RTOL[np.dtype("bfloat16")]


def inputs(b, t, h, kd, vd, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.normal(size=s).astype(dtype)
  return rng, dict(q=normal(b, t, h, kd), k=normal(b, t, h, kd),
                   v=normal(b, t, h, vd),
                   beta=rng.uniform(0.05, 1.0, (b, t, h)).astype(dtype))


def run(args, kw, backend):
  """(o, final state, grads of a random-cotangent loss), jitted."""
  return jax.jit(lambda a: loss_and_grads(a, kw, backend, seed=9))(args)


def check(args, kw, *, chunk, rtol=F32, oracle=True):
  """chunked (at `chunk`) and reference: finite, oracle forward, same grads."""
  o, s, grads = run(args, dict(kw, chunk_size=chunk), "chunked")
  o_ref, s_ref, grads_ref = run(args, kw, "reference")
  for name, x in [("output", o), ("final_state", s)] + list(grads.items()):
    assert np.all(np.isfinite(np.asarray(x, np.float32))), name
  if oracle:
    o_np, s_np = kda_numpy(**args, **kw)
    testing.assert_close(o, o_np, rtol=rtol, name="output")
    testing.assert_close(s, s_np, rtol=rtol, name="final_state")
    testing.assert_close(o_ref, o_np, rtol=rtol, name="reference output")
  for name in grads_ref:
    testing.assert_close(grads[name], grads_ref[name], rtol=rtol,
                         name=f"d{name}")
  return grads


@pytest.mark.parametrize("chunk", [16, 64])
def test_log_decay_exactly_zero_for_a_whole_sequence(chunk):
  # No decay at all (g = 0): the pure delta rule, every exponent exactly 0.
  _, args = inputs(2, 130, 2, 16, 8)
  args["g"] = np.zeros((2, 130, 2, 16), np.float32)
  args["initial_state"] = np.ones((2, 2, 16, 8), np.float32) * 0.1
  check(args, dict(use_qk_l2norm=True), chunk=chunk)


@pytest.mark.parametrize("chunk", [16, 64])
def test_gates_at_the_lower_bound_for_a_whole_chunk(chunk):
  # sigmoid saturates: every token of both chunks decays by exactly e^-5, so
  # a chunk spans -320 in log space and exp(+320) would overflow float32.
  rng, args = inputs(1, 128, 2, 32, 16, seed=1)
  args["g"] = np.full((1, 128, 2, 32), 1e4, np.float32)  # raw gate
  args["a_log"] = np.zeros((2,), np.float32)
  args["dt_bias"] = rng.normal(size=(64,)).astype(np.float32)
  kw = dict(use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=-5.0)
  grads = check(args, kw, chunk=chunk)
  # The saturated gate passes no gradient to the raw gate (sigmoid' = 0).
  # exact: sigmoid(1e4 + dt_bias) rounds to 1.0, so s * (1 - s) is 0.
  np.testing.assert_array_equal(np.asarray(grads["g"]), 0.0)


@pytest.mark.parametrize("chunk", [16, 64])
def test_small_entries_at_the_lower_bound_are_not_flushed_to_zero(chunk):
  # A 16-token block at -5 spans -80: an uncentred factor exp(-80) = 2e-35
  # times a query entry below 6.5e-4 is subnormal, which XLA:CPU flushes to
  # zero, and the intra-block scores of late tokens vanish.
  rng, args = inputs(1, 64, 2, 16, 8, seed=6)
  args["g"] = np.full((1, 64, 2, 16), 1e4, np.float32)  # saturated: -5
  args["a_log"] = np.zeros((2,), np.float32)
  kw = dict(use_gate_in_kernel=True, lower_bound=-5.0, scale=1e-4)
  check(args, kw, chunk=chunk)


@pytest.mark.parametrize("chunk", [16, 64])
def test_softplus_decays_of_minus_1000(chunk):
  # -exp(a_log) * softplus(raw) = -10 * 100 = -1000 per token: exp(-1000)
  # underflows to 0 and the masked exponent must not turn it into inf * 0.
  rng, args = inputs(2, 70, 2, 16, 8, seed=2)
  raw = np.full((2, 70, 2, 16), 100.0, np.float32)
  raw[:, ::7] = rng.normal(size=raw[:, ::7].shape)  # some mild tokens
  args.update(g=raw, a_log=np.full((2,), np.log(10.0), np.float32),
              initial_state=rng.normal(size=(2, 2, 16, 8)).astype(np.float32))
  kw = dict(use_qk_l2norm=True, use_gate_in_kernel=True)
  check(args, kw, chunk=chunk)


@pytest.mark.parametrize("chunk", [16, 64])
def test_padding_after_the_last_segment_and_all_padding_rows(chunk):
  rng, args = inputs(3, 80, 2, 16, 8, seed=3)
  args["g"] = rng.uniform(-3, 0, (3, 80, 2, 16)).astype(np.float32)
  args["initial_state"] = rng.normal(size=(3, 2, 2, 16, 8)).astype(np.float32)
  seg = np.zeros((3, 80), np.int32)
  seg[0, :40], seg[0, 40:50] = 1, 2  # 30 tokens of padding after the last
  seg[1, :79] = 1
  # row 2: padding only
  kw = dict(use_qk_l2norm=True, segment_ids=seg, max_num_segments=2)
  grads = check(args, kw, chunk=chunk)
  pad = seg == 0
  # exact: padding inputs are masked with jnp.where: zero cotangents.
  for name in ("q", "k", "v", "g", "beta"):
    np.testing.assert_array_equal(np.asarray(grads[name])[pad], 0.0,
                                  err_msg=f"d{name} at padding")
  # An all-padding row keeps its initial states: gradient 1 * ds passes.
  assert np.abs(np.asarray(grads["initial_state"])[2]).max() > 0


def _layer(**overrides):
  cfg = dict(num_heads=2, head_dim=16, lower_bound=-5.0, backend="chunked")
  cfg.update(overrides)

  def fwd(x, segment_ids=None, cache=None):
    layer = KimiDeltaAttention(**cfg, name="kda")
    y, new_cache = layer(x, segment_ids=segment_ids, cache=cache)
    return y if cache is None else (y, new_cache)
  return hk.without_apply_rng(hk.transform(fwd))


def _noisy_params(f, x):
  params = f.init(jax.random.key(1), x)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  return jax.tree.unflatten(tree, [
      p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def _float64_on_host(f, params, x):
  """The layer's forward in float64 on the host's CPU: the oracle both the
  forward and the decode are held to (independent of the device)."""
  with testing.float64_on_host():
    to64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)
    return np.asarray(f.apply(jax.tree.map(to64, params), to64(x)))


def _decode(f, params, x, cache):
  """Feeds x one token at a time (one compiled scan); returns [B, T, D]."""
  def step(cache, x_t):
    y, cache = f.apply(params, x_t[:, None], None, cache)
    return cache, y[:, 0]
  _, ys = jax.lax.scan(step, cache, jnp.moveaxis(x, 1, 0))
  return jnp.moveaxis(ys, 0, 1)


# Lengths 1 to 70 at every edge: below, at and past the conv window (4), a
# 16-token chunk (CPU: one, two and several chunks) and a 64-token chunk
# (accelerators). Each length is one compile of the layer's forward and
# backward (~5-10 s on a 2-core CPU), so each chunk size takes only its own
# edges.
SHORT_LENGTHS = {16: (1, 4, 5, 16, 17, 70),
                 64: (1, 63, 64, 65)}


@pytest.mark.slow
@pytest.mark.parametrize("chunk", sorted(SHORT_LENGTHS))
def test_short_sequences_train_and_decode(chunk):
  # T <= 64 is a single partial chunk (or none at all on 64-token chunks);
  # T < conv window leaves the conv's prefix half empty. Decoding is causal,
  # so one 70-token decode gives the decoded output of every length.
  f = _layer(chunk_size=chunk)
  x = jax.random.normal(jax.random.key(0), (2, 70, 32))
  params = _noisy_params(f, x[:, :8])
  cache = kda_module.init_kda_cache(2, num_heads=2, head_dim=16)
  cot = jax.random.normal(jax.random.key(3), x.shape)

  @jax.jit
  def forward_and_grads(params, x):
    loss = lambda p, x: jnp.sum(f.apply(p, x) * cot[:, :x.shape[1]])
    return f.apply(params, x), jax.grad(loss, (0, 1))(params, x)

  decoded = jax.jit(functools.partial(_decode, f))(params, x, cache)
  # Both paths against the layer in float64 on the host's CPU (causal: one
  # 70-token forward gives every length's). On a CPU both are within
  # 2.6e-7..2.9e-7 of it. On a TPU v5e (ops_random at dc64d6d) every
  # forward was within 1e-5 and the decode (the token recurrence) was not:
  # 1.15e-5 at T 70, 1.04e-5 at T 63 (docs/tpu.md).
  y64 = _float64_on_host(f, params, x)
  for t in SHORT_LENGTHS[chunk]:
    y, grads = forward_and_grads(params, x[:, :t])
    testing.assert_close(y, y64[:, :t], rtol=F32, name=f"T={t} forward")
    testing.assert_close(decoded[:, :t], y64[:, :t], rtol=F32,
                         name=f"T={t} decoded")
    for g in jax.tree.leaves(grads):
      assert np.all(np.isfinite(np.asarray(g))), f"T={t}"


def _numpy_conv(x, w, ids):
  """Causal depthwise conv + SiLU from its definition, in float64."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  b, t, c = x.shape
  y = np.zeros((b, t, c))
  for bi in range(b):
    for ti in range(t):
      if ids[bi, ti] == 0:
        continue
      for s in range(w.shape[0]):  # s steps back, stopped by another run
        src = ti - s
        if src < 0 or ids[bi, src] not in (0, ids[bi, ti]):
          break
        if ids[bi, src] == ids[bi, ti]:
          y[bi, ti] += w[w.shape[0] - 1 - s] * x[bi, src]
      y[bi, ti] = y[bi, ti] / (1 + np.exp(-y[bi, ti]))
  return y


@pytest.mark.parametrize("width", [17, 24])
def test_conv_window_longer_than_a_chunk_or_a_rank(width):
  # Width 17 and 24 reach past a 16-token chunk, past a whole 8-token rank
  # shard (8 ranks x 8 tokens), and past whole documents.
  rng = np.random.default_rng(4)
  x = rng.normal(size=(2, cp_common.T, 6)).astype(np.float32)
  w = rng.normal(size=(width, 6)).astype(np.float32) * 0.3
  ids = cp_common.packed_segment_ids()
  expected = _numpy_conv(x, w, ids)
  y = ops.short_conv1d(jnp.asarray(x), jnp.asarray(w),
                       segment_ids=jnp.asarray(ids))
  testing.assert_close(y, expected, rtol=F32, name="single device")
  spec = jax.sharding.PartitionSpec(None, "context")
  sharded = jax.jit(jax.shard_map(
      lambda x, ids: ops.short_conv1d(x, jnp.asarray(w), segment_ids=ids,
                                      context_axis="context"),
      mesh=cp_common.mesh(8), in_specs=(spec, spec), out_specs=spec))
  testing.assert_close(sharded(x, ids), expected, rtol=F32, name="8 ranks")
  # Through the layer: a conv window longer than the KDA chunk.
  f = _layer(conv_size=width)
  xs = jax.random.normal(jax.random.key(5), (1, 40, 32))
  params = _noisy_params(f, xs)
  y = jax.jit(f.apply)(params, xs)
  cache = kda_module.init_kda_cache(1, num_heads=2, head_dim=16,
                                    conv_size=width)
  testing.assert_close(y, jax.jit(functools.partial(_decode, f))(
      params, xs, cache), rtol=F32, name="layer forward vs decode")


@pytest.mark.slow
def test_bf16_decays_within_1e_3_of_one_over_4096_tokens():
  # exp(g) for g in [-1e-3, 0) is 1 in bf16 (its spacing near 1 is 2^-8):
  # a kernel that rounds the decay (or beta) through bf16 stops forgetting,
  # which over 4096 tokens changes the state by a factor ~e^-2. The
  # products run at HIGHEST, so only the storage dtypes are tested: at
  # "auto" a TPU multiplies bfloat16 compute in one bfloat16 pass, and the
  # state is then 5.6e-3 from the float64 one (measured on a v5e; the
  # products' rounding, three orders below what a rounded decay does).
  rng, args = inputs(1, 4096, 1, 32, 32, seed=5)
  args["g"] = rng.uniform(-1e-3, -1e-5, (1, 4096, 1, 32)).astype(np.float32)
  bf16 = {n: jnp.asarray(x, jnp.bfloat16) for n, x in args.items()}
  rounded = {n: x.astype(jnp.float32) for n, x in bf16.items()}
  kw = dict(use_qk_l2norm=True)
  o, s, grads = run(bf16, dict(kw, precision="highest"), "chunked")
  assert o.dtype == jnp.bfloat16
  # The float32 state against the float64 oracle on the rounded inputs. On
  # a TPU v5e the float32 `reference` backend (one exp(g) a token) drifted
  # from this state by 8.0e-5 over the 4096 tokens (ops_random at dc64d6d,
  # benchmarks/results/tpu_suite_v5e): it is not the oracle here.
  o_np, s_np = kda_numpy(**rounded, **kw)
  testing.assert_close(o, o_np, rtol=BF16, name="output vs oracle")
  testing.assert_close(s, s_np, rtol=F32, name="final_state vs oracle")
  _, _, grads_ref = run(rounded, kw, "reference")
  for name in grads_ref:
    testing.assert_close(grads[name], grads_ref[name], rtol=BF16,
                         name=f"d{name}")


@pytest.mark.slow
def test_decode_of_1000_tokens_one_at_a_time_matches_the_full_forward():
  for lower_bound in (-5.0, None):
    f = _layer(lower_bound=lower_bound)
    x = jax.random.normal(jax.random.key(6), (2, 1000, 32))
    params = _noisy_params(f, x[:, :8])
    full = jax.jit(f.apply)(params, x)
    cache = kda_module.init_kda_cache(2, num_heads=2, head_dim=16)
    decoded = jax.jit(functools.partial(_decode, f))(params, x, cache)
    # Each path against the float64 layer on the host: on a TPU v5e the two
    # differed by 2.1e-5 (ops_random at dc64d6d), which this tells apart.
    y64 = _float64_on_host(f, params, x)
    testing.assert_close(full, y64, rtol=F32,
                         name=f"lower_bound={lower_bound} forward")
    testing.assert_close(decoded, y64, rtol=F32,
                         name=f"lower_bound={lower_bound} decoded")
