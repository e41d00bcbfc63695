"""Tests for the `KimiDeltaAttention` Haiku layer and `configs/layers.py`.

The layer is checked against an independent composition written here from
the paper's equations (arXiv 2510.26692, §4) around tokamax's own `xla` KDA
(head-first [H, B, T, *] layout), across its three backends, and against
itself only where the claim is an identity (decode == full forward, segment
isolation).
"""

import dataclasses
import math

from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokamax

from configs import common as config_common
from configs import layers as layer_configs
from experiments.training import interpret
from experiments.training import model as model_lib
from linear_attention import ops
from linear_attention import testing
from linear_attention.modules import KDACache
from linear_attention.modules import KimiDeltaAttention
from linear_attention.modules import kda as kda_module
from linear_attention.modules.kda import validate_kda_layer_args

H, K, D = 2, 16, 32
F32_RTOL = testing.RTOL[np.dtype("float32")]  # 1e-5


def _transform(**overrides):
  cfg = dict(num_heads=H, head_dim=K, lower_bound=-5.0, backend="chunked")
  cfg.update(overrides)

  def fwd(x, segment_ids=None, cache=None):
    layer = KimiDeltaAttention(**cfg, name="kda")
    y, new_cache = layer(x, segment_ids=segment_ids, cache=cache)
    return y if cache is None else (y, new_cache)

  return hk.transform(fwd)


def _x(b=2, t=20, seed=0):
  return jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)


def _params(f, x, seed=1):
  """Initialised params plus noise, so that every parameter matters."""
  params = f.init(jax.random.key(seed), x)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  return jax.tree.unflatten(tree, [
      p + 0.1 * jax.random.normal(kk, p.shape) for p, kk in zip(leaves, keys)])


def _loss_and_grads(apply, params, x, segment_ids=None):
  """y, and d/d(x, params) of sum(y * fixed random cotangent)."""
  y = apply(params, None, x, segment_ids)
  # Drawn in float32 and cast, so a float64 oracle sees the same cotangent.
  cot = jax.random.normal(jax.random.key(7), y.shape,
                          jnp.float32).astype(y.dtype)
  grad = jax.grad(
      lambda p, x: jnp.sum(apply(p, None, x, segment_ids) * cot), (0, 1))
  return y, grad(params, x)


def _assert_tree_close(actual, expected, rtol, name):
  actual = jax.tree_util.tree_leaves_with_path(actual)
  expected = jax.tree_util.tree_leaves_with_path(expected)
  assert [p for p, _ in actual] == [p for p, _ in expected]
  for (path, a), (_, e) in zip(actual, expected):
    testing.assert_close(a, e, rtol=rtol,
                         name=name + jax.tree_util.keystr(path))


def tokamax_composed_layer(params, x, segment_ids=None, *, lower_bound,
                           decay="channel", num_v_heads=H,
                           allow_neg_eigval=False):
  """The layer's forward from the paper, with tokamax's `xla` KDA as core.

  Grouped value heads: tokamax takes one q/k head per value head, so q and k
  head i are given to value heads i * G .. (i + 1) * G - 1 (G = HV / H).
  """
  p = lambda n: params["kda/" + n]["w"]
  b, t, _ = x.shape
  hv = num_v_heads

  def conv_silu(y, w):  # causal depthwise conv, w[-1] on the current token
    if segment_ids is not None:  # tested against NumPy in tests/ops
      return ops.short_conv1d(y, w, segment_ids=segment_ids)
    width = w.shape[0]
    pad = jnp.pad(y, ((0, 0), (width - 1, 0), (0, 0)))
    return jax.nn.silu(sum(w[j] * pad[:, j:j + t] for j in range(width)))

  heads_first = lambda a: jnp.moveaxis(a.reshape(b, t, hv, -1), 2, 0)
  per_value_head = lambda a: jnp.concatenate(
      [a.reshape(b, t, H, -1)[:, :, j * H // hv] for j in range(hv)], -1)
  q = per_value_head(conv_silu(x @ p("q_proj"), p("q_conv1d")))
  k = per_value_head(conv_silu(x @ p("k_proj"), p("k_conv1d")))
  v = conv_silu(x @ p("v_proj"), p("v_conv1d"))
  top = params["kda"]
  if decay == "channel":
    g_raw, dt_bias = x @ p("f_a_proj") @ p("f_b_proj"), top["dt_bias"]
  else:
    g_raw = jnp.repeat(x @ p("f_proj"), K, axis=-1)  # [B, T, H*K]
    dt_bias = jnp.repeat(top["dt_bias"], K)
  beta = jax.nn.sigmoid(x @ p("b_proj"))  # [B, T, HV]
  if allow_neg_eigval:
    beta = 2.0 * beta
  o, _ = tokamax.ops.kimi_delta_attention(
      heads_first(q), heads_first(k), heads_first(v), heads_first(g_raw),
      jnp.moveaxis(beta, 2, 0), a_log=top["a_log"], delta_time_bias=dt_bias,
      use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=lower_bound,
      segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
      max_num_segments=None if segment_ids is None else 2,
      implementation="xla")
  o = jnp.moveaxis(o, 0, 2)  # [B, T, H, V]
  o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-5)
  o = (o * params["kda/o_norm"]["scale"]).reshape(b, t, -1)
  o = o * jax.nn.sigmoid(x @ p("g_a_proj") @ p("g_b_proj"))
  return o @ p("o_proj")


class KimiDeltaAttentionTest(chex.TestCase):

  @parameterized.parameters(
      dict(kw={}, drop=(), extra={}),
      dict(kw=dict(decay="head", expand_v=2.0), drop=("f_a_proj", "f_b_proj"),
           extra={"kda/f_proj": {"w": (D, H)}}),
      dict(kw=dict(conv_size=0, use_output_gate=False),
           drop=("q_conv1d", "k_conv1d", "v_conv1d", "g_a_proj", "g_b_proj"),
           extra={}),
  )
  def test_parameter_names_and_shapes(self, kw, drop, extra):
    v = int(K * kw.get("expand_v", 1))
    bias = (H,) if kw.get("decay") == "head" else (H * K,)
    want = {
        "kda": {"a_log": (H,), "dt_bias": bias},
        "kda/q_proj": {"w": (D, H * K)}, "kda/k_proj": {"w": (D, H * K)},
        "kda/v_proj": {"w": (D, H * v)},
        "kda/q_conv1d": {"w": (4, H * K)}, "kda/k_conv1d": {"w": (4, H * K)},
        "kda/v_conv1d": {"w": (4, H * v)},
        "kda/f_a_proj": {"w": (D, K)}, "kda/f_b_proj": {"w": (K, H * K)},
        "kda/b_proj": {"w": (D, H)},
        "kda/o_norm": {"scale": (v,)},
        "kda/g_a_proj": {"w": (D, K)}, "kda/g_b_proj": {"w": (K, H * v)},
        "kda/o_proj": {"w": (H * v, D)},
    }
    want = {n: s for n, s in want.items() if n.split("/")[-1] not in drop}
    want.update(extra)
    params = jax.eval_shape(_transform(**kw).init, jax.random.key(0),
                            _x(1, 5))
    got = {m: {n: tuple(a.shape) for n, a in d.items()}
           for m, d in params.items()}
    assert got == want, got

  @parameterized.parameters(None, -5.0)
  def test_initialisation(self, lower_bound):
    f = _transform(lower_bound=lower_bound, num_heads=2, head_dim=64)
    params = jax.jit(f.init)(jax.random.key(0), _x(1, 5))
    a_log, dt_bias = params["kda"]["a_log"], params["kda"]["dt_bias"]
    if lower_bound is None:  # log U(1, 16)
      assert np.all((a_log >= 0) & (a_log <= math.log(16))) and a_log.std() > 0
    else:  # exact: initialised with jnp.zeros
      np.testing.assert_array_equal(a_log, 0.0)
    dt = np.asarray(jax.nn.softplus(dt_bias), np.float64)  # = the sampled dt
    assert np.all((dt >= 1e-3 * (1 - 1e-4)) & (dt <= 1e-1 * (1 + 1e-4)))
    assert np.log(dt).std() > 0.5  # log-uniform over two decades: std 1.33
    w = np.asarray(params["kda/q_proj"]["w"])
    assert abs(w.std() - 0.02) < 0.002 and abs(w).max() > 0.04  # untruncated

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_composition_with_tokamax_xla_core(self):
    self._check_against_tokamax_composition(self.variant, -5.0, "channel")

  @parameterized.parameters(
      dict(lower_bound=None, decay="channel", segmented=True),
      dict(lower_bound=-2.0, decay="head"),
      dict(lower_bound=None, decay="channel", segmented=True,
           layer=dict(num_v_heads=4, allow_neg_eigval=True)),
  )
  def test_matches_composition_with_tokamax_xla_core_other_gates(
      self, lower_bound, decay, segmented=False, layer=None):
    self._check_against_tokamax_composition(jax.jit, lower_bound, decay,
                                            segmented, layer or {})

  def _check_against_tokamax_composition(self, wrap, lower_bound, decay,
                                         segmented=False, layer=None):
    # The composition runs in float64 on the host's CPU: an oracle, and one
    # that does not share the chip's float32 exp (biased -1.35e-6 near zero
    # on a v5e, benchmarks/results/elementwise_accuracy_v5e.json), which put
    # tokamax's float32 composition 1.1e-5..1.8e-5 off ours there (y, dx,
    # dparams; suite at e3a765f). Measured relative L2 against it on CPU
    # (y, dx, max over dparams): softplus/channel/segments 2.9e-7, 4.0e-7,
    # 5.7e-7 (tokamax's own float32 composition: 3.0e-7, 4.1e-7, 5.4e-7).
    layer = layer or {}
    f = _transform(lower_bound=lower_bound, decay=decay, backend="reference",
                   **layer)
    x = _x(2, 19)
    seg = np.array([[1] * 7 + [2] * 10 + [0] * 2, [0] * 2 + [1] * 17],
                   np.int32) if segmented else None
    params = _params(f, x)
    y, grads = _loss_and_grads(wrap(f.apply), params, x, seg)
    apply_ref = jax.jit(lambda p, _, x, s: tokamax_composed_layer(
        p, x, s, lower_bound=lower_bound, decay=decay,
        num_v_heads=layer.get("num_v_heads", H),
        allow_neg_eigval=layer.get("allow_neg_eigval", False)))
    with testing.float64_on_host():
      wide = lambda a: jnp.asarray(a, jnp.float64)
      want_y, want_grads = jax.device_get(_loss_and_grads(
          apply_ref, jax.tree.map(wide, params), wide(x), seg))
    testing.assert_close(y, want_y, rtol=F32_RTOL, name="y")
    testing.assert_close(grads[1], want_grads[1], rtol=F32_RTOL, name="dx")
    _assert_tree_close(grads[0], want_grads[0], F32_RTOL, "dparams")

  @pytest.mark.slow
  def test_reference_and_chunked_agree_with_segments(self, lower_bound=None):
    x = _x(2, 70)  # crosses a chunk boundary, not a multiple of 64
    seg = np.array([[1] * 30 + [2] * 35 + [0] * 5,
                    [0] * 3 + [1] * 60 + [2] * 7], np.int32)
    results = {}
    for backend in ("reference", "chunked"):
      f = _transform(lower_bound=lower_bound, backend=backend)
      params = _params(f, x)
      results[backend] = _loss_and_grads(jax.jit(f.apply), params, x, seg)
    (y_r, g_r), (y_c, g_c) = results["reference"], results["chunked"]
    testing.assert_close(y_c, y_r, rtol=F32_RTOL, name="y")
    testing.assert_close(g_c[1], g_r[1], rtol=F32_RTOL, name="dx")
    _assert_tree_close(g_c[0], g_r[0], F32_RTOL, "dparams")

  # Pallas interpret mode is tokamax's kernel's check off TPU. On a TPU the
  # interpreter's matmuls run at the chip's default precision (y 3.1e-3
  # against the bound 1e-4 on a v5e: benchmarks/results/tpu_suite_v5e/
  # 64a27c3-tpu-tests-modules-cut_at_400s.xml), and a v5e refuses the
  # compiled kernel (linear_attention/ops/kda/tokamax_kernel.py,
  # V5E_MEASURED).
  @pytest.mark.slow
  @pytest.mark.skipif(jax.default_backend() == "tpu",
                      reason="Pallas interpret mode is the kernel's check off"
                      " TPU; on a TPU the interpreter runs at the chip's"
                      " default precision")
  def test_mosaic_matches_reference(self):
    # Measured relative L2 vs reference: mosaic 2.9e-7 (y), 3.7e-7 (dx),
    # <= 1.5e-6 (dparams); chunked on the same case 2.5e-7, 3.5e-7, 5.4e-7.
    x = _x(1, 64)  # the kernel needs T % 64 == 0 without segments
    f_ref = _transform(backend="reference")
    params = _params(f_ref, x)
    y_r, g_r = _loss_and_grads(jax.jit(f_ref.apply), params, x)
    f_mos = _transform(backend="mosaic")
    with interpret.interpret_mode():
      y_m, g_m = _loss_and_grads(jax.jit(f_mos.apply), params, x)
    testing.assert_close(y_m, y_r, rtol=1e-4, name="y")
    testing.assert_close(g_m[1], g_r[1], rtol=1e-4, name="dx")
    _assert_tree_close(g_m[0], g_r[0], 1e-4, "dparams")

  @parameterized.parameters(
      dict(lower_bound=None),
      dict(lower_bound=-5.0),
      dict(lower_bound=None, backend="reference", decay="head", conv_size=0,
           expand_v=0.5),
      dict(lower_bound=None, num_v_heads=4, allow_neg_eigval=True),
  )
  def test_decode_equals_full_forward(self, **kw):
    f = _transform(**kw)
    x = _x(2, 20)
    params = _params(f, x)
    step = jax.jit(f.apply)
    full = step(params, None, x)
    for prefill in (0, 1, 5, 17):
      cache = kda_module.init_kda_cache(
          2, num_heads=H, head_dim=K, expand_v=kw.get("expand_v", 1.0),
          conv_size=kw.get("conv_size", 4),
          num_v_heads=kw.get("num_v_heads"))
      ys = []
      if prefill:
        y, cache = step(params, None, x[:, :prefill], None, cache)
        ys.append(y)
      for t in range(prefill, 20):
        y, cache = step(params, None, x[:, t:t + 1], None, cache)
        ys.append(y)
      testing.assert_close(jnp.concatenate(ys, 1), full, rtol=F32_RTOL,
                           name=f"prefill {prefill}")
      assert isinstance(cache, KDACache)
      chex.assert_shape(cache.state, (2, kw.get("num_v_heads", H), K,
                                      int(K * kw.get("expand_v", 1))))

  def test_decode_after_padded_prefill(self):
    # Row 0's prompt is right-padded by 3; its decode continues document 1.
    f = _transform(lower_bound=None)
    x = _x(2, 14)
    params = _params(f, x)
    seg = np.ones((2, 14), np.int32)
    seg[0, 5:8] = 0
    step = jax.jit(f.apply)
    full = step(params, None, x, seg)
    cache = kda_module.init_kda_cache(2, num_heads=H, head_dim=K)
    y, cache = step(params, None, x[:, :8], seg[:, :8], cache)
    ys = [y]
    for t in range(8, 14):
      y, cache = step(params, None, x[:, t:t + 1], None, cache)
      ys.append(y)
    testing.assert_close(jnp.concatenate(ys, 1), full, rtol=F32_RTOL,
                         name="y")
    # exact: the core writes o = jnp.where(valid, o, 0) at padding, and the
    # output norm, gate product and bias-free o_proj keep a zero row zero.
    np.testing.assert_array_equal(np.asarray(full)[0, 5:8], 0.0)  # padding

  @parameterized.parameters(dict(segmented=False), dict(segmented=True))
  def test_chunk_caches_continue_the_sequence_like_a_prefill(self, segmented):
    # Grouped value heads and beta in [0, 2] ride along; C=6 < T=23 with a
    # partial last chunk; W - 1 = 3 taps of conv tail.
    # The reference core compiles fastest; both cores' chunk states are
    # checked against the float64 oracle in tests/ops.
    cfg = dict(num_heads=H, head_dim=K, lower_bound=None, num_v_heads=4,
               allow_neg_eigval=True, backend="reference")

    def fwd(x, seg=None, cache=None, every=None):
      layer = KimiDeltaAttention(**cfg, name="kda")
      if every is not None:
        return layer.chunk_caches(x, segment_ids=seg, every=every)
      y, new_cache = layer(x, segment_ids=seg, cache=cache)
      return y if cache is None else (y, new_cache)

    f = hk.transform(fwd)
    t, every = 23, 6
    x = _x(2, t)
    params = _params(f, x)
    seg = None
    if segmented:  # documents that end inside a conv window, and padding
      seg = np.array([[1] * 10 + [2] * 9 + [0] * 4,
                      [1] * 4 + [2] * 7 + [3] * 12], np.int32)
    apply = jax.jit(f.apply, static_argnames="every")
    full = apply(params, None, x, seg)
    y, caches = apply(params, None, x, seg, every=every)
    testing.assert_close(y, full, rtol=F32_RTOL, name="y")
    chex.assert_shape(caches.state, (2, t // every, 4, K, K))
    chex.assert_shape(caches.v_conv, (2, t // every, 3, 4 * K))
    for j in range(t // every):
      p = (j + 1) * every
      cache = jax.tree.map(lambda a: a[:, j], caches)
      if segmented:
        same = seg[:, p:] == seg[:, p - 1:p]  # the boundary's document
        same &= seg[:, p - 1:p] != 0
        y, _ = apply(params, None, x[:, p:], same.astype(np.int32), cache)
        np.testing.assert_array_less(0, same.sum())
        testing.assert_close(np.asarray(y)[same], np.asarray(full)[:, p:][same],
                             rtol=F32_RTOL, name=f"y after boundary {j}")
      else:
        y, _ = apply(params, None, x[:, p:], None, cache)
        testing.assert_close(y, full[:, p:], rtol=F32_RTOL,
                             name=f"y after boundary {j}")
        # ... and the cache is the one a prefill of those tokens leaves.
        _, prefilled = apply(params, None, x[:, :p], None,
                             kda_module.init_kda_cache(2, num_heads=H,
                                                       head_dim=K,
                                                       num_v_heads=4))
        for name, a, want in zip(KDACache._fields, cache, prefilled):
          testing.assert_close(a, want, rtol=F32_RTOL, name=f"{name} {j}")
    with pytest.raises(ValueError, match="every must be an int >= 1"):
      apply(params, None, x, seg, every=0)

  def test_bfloat16_outputs_are_within_the_bf16_tolerance(self):
    # Mixed precision as the experiments run it: bf16 parameters and input.
    f = _transform(lower_bound=None)
    x = _x(2, 40)
    params = _params(f, x)
    want = jax.jit(f.apply)(params, None, x)
    low = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    y = jax.jit(f.apply)(low, None, x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    testing.assert_close(y.astype(jnp.float32), want,
                         rtol=testing.RTOL[np.dtype(jnp.bfloat16)], name="y")

  def test_segment_isolation(self):
    # On the reference core isolation is exact. (The chunked core shares a
    # chunk between documents: it rounds differently by ~1 ulp in y and gives
    # ~1e-9 cross-document input gradients; the op's tests cover it.)
    f = _transform(lower_bound=None, backend="reference")
    seg = np.array([[1] * 9 + [2] * 12 + [0] * 4 + [3] * 5], np.int32)
    x = _x(1, 30)
    params = _params(f, x)
    apply = jax.jit(f.apply)
    y0 = np.asarray(apply(params, None, x, seg))
    x1 = x.at[:, 9:21].add(3.0 * _x(1, 12, seed=5))  # change document 2 only
    y1 = np.asarray(apply(params, None, x1, seg))
    doc2 = seg == 2
    # exact: the same compiled apply; document 2 reaches other tokens only
    # through jnp.where (the core's state reset, the conv's mask), so they
    # compute the same arithmetic on the same values.
    np.testing.assert_array_equal(y1[~doc2], y0[~doc2])
    assert np.abs(y1[doc2] - y0[doc2]).max() > 1e-2  # the change is seen
    # exact: o = jnp.where(valid, o, 0) at padding; a zero row stays zero.
    np.testing.assert_array_equal(y0[seg == 0], 0.0)  # padding outputs zero
    grad_x = jax.jit(jax.grad(
        lambda x, mask: jnp.sum(f.apply(params, None, x, seg) * mask)))
    for doc in (1, 2, 3):  # input gradients stay inside the document
      dx = np.asarray(grad_x(x, jnp.asarray(seg == doc)[..., None]))
      # exact: other tokens get their cotangent through jnp.where: zeros.
      np.testing.assert_array_equal(dx[seg != doc], 0.0)
      assert np.abs(dx[seg == doc]).max() > 0

  def test_config_builds_the_layer_and_is_locked(self):
    config = layer_configs.kda_config()
    fields = {f.name for f in dataclasses.fields(KimiDeltaAttention)}
    assert set(config.keys()) == fields - {"name"}
    config.head_dim = 8
    f = hk.transform(lambda x: KimiDeltaAttention(**config)(x)[0])
    x = _x(1, 4)
    params = jax.eval_shape(f.init, jax.random.key(0), x)
    chex.assert_shape(jax.eval_shape(f.apply, params, None, x), x.shape)
    with pytest.raises(AttributeError):
      config.num_head = 4  # misspelt
    config.lower_bound = None  # the softplus gate is representable
    validate_kda_layer_args(**config)
    config.lower_bound = -1.0
    validate_kda_layer_args(**config)

  @parameterized.parameters(
      ("num_heads", 0), ("head_dim", 0), ("head_dim", -4),
      ("expand_v", 0.0), ("expand_v", -1.0), ("expand_v", 1.03),
      ("expand_v", float("nan")), ("conv_size", -1),
      ("lower_bound", -6.0), ("lower_bound", 0.0), ("lower_bound", 1.0),
      ("lower_bound", float("nan")), ("lower_bound", float("-inf")),
      ("backend", "tpu"), ("decay", "token"), ("num_v_heads", 3),
      ("num_v_heads", 0), ("chunk_size", 32),
  )
  def test_bad_argument_raises_value_error_naming_it(self, name, value):
    kw = dict(layer_configs.kda_config())
    kw[name] = value
    with pytest.raises(ValueError, match=f"^{name}") as from_layer:
      hk.transform(lambda: KimiDeltaAttention(**kw)).init(None)
    # The experiment config fails the same way when the model is built,
    # naming its section.
    model = config_common.model_config()
    model.kda[name] = value
    with pytest.raises(ValueError) as from_config:
      model_lib.validate_model_config(model, vocab_size=16)
    assert str(from_config.value) == f"model.kda: {from_layer.value}"

  def test_cache_of_the_wrong_shape_raises(self):
    f = _transform()
    x = _x(2, 3)
    params = jax.eval_shape(f.init, jax.random.key(0), x)
    cache = kda_module.init_kda_cache(2, num_heads=H, head_dim=K,
                                      conv_size=3)
    with pytest.raises(ValueError, match="^cache.q_conv"):
      jax.eval_shape(f.apply, params, None, x, None, cache)
