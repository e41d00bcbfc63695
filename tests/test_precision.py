"""Every matmul of every module runs at its module's precision.

A CPU multiplies float32 exactly at any precision, so these tests read the
program lowered for a TPU on any host (`tests/lowered.py`; the CPU's
lowering hides a mixed-dtype dot behind converts): every `dot_general` and
`convolution` of the model's forward and backward, of the attention layer,
the CSA indexer op (each backend) and module, and of the short
convolution. Each must keep its precision under two opposite process
defaults (it is pinned), and at "auto":

* float32 compute: every matmul HIGHEST;
* bfloat16 compute: every matmul with a bfloat16 operand DEFAULT (one
  pass); a matmul on float32 operands may be HIGHEST (the KDA op's decay
  range sums, the CSA score's head sums: always HIGHEST) or DEFAULT (the
  KDA op's state products at "auto").

The KDA op's groups are tested in tests/ops/test_kda_precision.py.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common as config_lib
from configs import validation as config_checks
from experiments.training import model as model_lib
from linear_attention import modules
from linear_attention import ops
from linear_attention.modules import attention
from linear_attention.ops import precision as precision_lib
from tests import lowered

V, T = 16, 16
HIGHEST, DEFAULT = ("HIGHEST", "HIGHEST"), ("DEFAULT", "DEFAULT")
DTYPES = ("float32", "bfloat16")


def _score_loss(scores):
  """A loss of the visible scores (the rest are -inf)."""
  return jnp.sum(jnp.where(jnp.isinf(scores), 0.0, scores) ** 2)


def _check_auto(found, dtype):
  """`found` (`lowered.pinned`'s) follows "auto" for `dtype` compute."""
  assert found, "no matmul lowered"
  if dtype == "float32":
    wrong = [m for m in found if m.precision != HIGHEST]
  else:
    wrong = [m for m in found if m.precision != DEFAULT and (
        "bf16" in m.dtypes or m.precision != HIGHEST)]
  assert not wrong, f"{dtype} compute at 'auto': {wrong}"


def _model_config(dtype="float32", **diff):
  model = config_lib.model_config(mixer="kda,attention", num_layers=2,
                                  d_model=16, mlp_hidden=32, num_heads=2,
                                  head_dim=8)
  model.compute_dtype = dtype
  for path, value in diff.items():
    *parents, leaf = path.split(".")
    node = model
    for p in parents:
      node = node[p]
    node[leaf] = value
  return model


def _model_matmuls(model, cached=False):
  """The pinned matmuls of the model's loss gradient (forward included),
  or with `cached` of a prefill that returns the decode cache."""
  lm = model_lib.make_model(model, V)
  tokens = jax.random.randint(jax.random.key(0), (2, T), 1, V)
  params = lm.init(jax.random.key(1), tokens)
  if cached:
    cache = model_lib.init_cache(model, 2, max_len=2 * T)
    return lowered.pinned(lambda p, t, c: lm.apply(p, t, cache=c),
                          params, tokens, cache)
  ids = jnp.where(jnp.arange(T) < 9, 1, 2)[None].repeat(2, 0)
  loss = lambda p, t: jnp.sum(lm.apply(p, t, ids) ** 2)
  return lowered.pinned(jax.grad(loss), params, tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_models_matmuls_follow_auto(dtype):
  _check_auto(_model_matmuls(_model_config(dtype)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_models_cached_forward_follows_auto(dtype):
  _check_auto(_model_matmuls(_model_config(dtype), cached=True), dtype)


def test_model_precision_reaches_every_matmul():
  # kda.precision None follows model.precision, as attention's does.
  found = _model_matmuls(_model_config(
      "bfloat16", precision="highest", **{"kda.precision": None}))
  assert {m.precision for m in found} == {HIGHEST}, found


def test_a_sections_own_precision_overrides_the_models():
  # KDA's default "auto" (one pass for bfloat16) under model "highest".
  found = _model_matmuls(_model_config("bfloat16", precision="highest"))
  assert {m.precision for m in found} == {HIGHEST, DEFAULT}, found


def _attention_grad(dtype, precision="auto"):
  f = hk.transform(lambda x, ids: modules.ShortConvSoftmaxAttention(
      num_heads=2, head_dim=8, precision=precision)(x, segment_ids=ids)[0])
  x = jax.random.normal(jax.random.key(0), (2, T, 16), dtype)
  ids = jnp.where(jnp.arange(T) < 5, 1, 2)[None].repeat(2, 0)
  params = f.init(jax.random.key(1), x, ids)
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  loss = lambda p, x: jnp.sum(f.apply(p, None, x, ids).astype(
      jnp.float32) ** 2)
  return lowered.pinned(jax.grad(loss, argnums=(0, 1)), params, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_attention_layer_follows_auto(dtype):
  found = _attention_grad(jnp.dtype(dtype))
  # The projections (4), q k^T and the weighted sum of v, each forward
  # and for both operands' gradients: nothing else multiplies.
  assert len(found) == 18, found
  _check_auto(found, dtype)


@pytest.mark.parametrize("name, want", [("default", DEFAULT),
                                        ("high", ("HIGH", "HIGH"))])
def test_the_attention_layer_takes_its_precision(name, want):
  found = _attention_grad(jnp.float32, name)
  assert {m.precision for m in found} == {want}, found


@pytest.mark.parametrize("mask", ["causal", "documents"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_is_jaxs_dot_product_attention(dtype, mask):
  """The same numbers as `jax.nn.dot_product_attention` (which the layer
  used before it pinned its precision), bit for bit on any platform.

  jax's takes no precision: it multiplies at the process default, one
  bfloat16 pass for float32 on a TPU, where ours is pinned HIGHEST at
  "auto". So jax's is jitted inside `jax.default_matmul_precision` of our
  precision's name ("highest" for float32, "default" for bfloat16).
  """
  dtype = jnp.dtype(dtype)
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 9, 3, 8), dtype)
             for i in range(3))
  m = jnp.tril(jnp.ones((9, 9), bool))[None, None]
  if mask == "documents":
    ids = jnp.array([[1] * 4 + [2] * 5, [1] * 9])
    m = m & (ids[:, None, :, None] == ids[:, None, None, :])
  prec = precision_lib.for_dtype("auto", dtype)
  ours = lambda q, k, v: attention.attend(q, k, v, m, prec)
  jaxs = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=m, implementation="xla")
  grad = lambda f: jax.jit(jax.grad(
      lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))
  with jax.default_matmul_precision(prec.name.lower()):
    want, want_grads = jax.jit(jaxs)(q, k, v), grad(jaxs)(q, k, v)
  np.testing.assert_array_equal(np.asarray(jax.jit(ours)(q, k, v), float),
                                np.asarray(want, float))
  if dtype == jnp.float32:  # gradients: the same sums, up to their order
    for a, b in zip(grad(ours)(q, k, v), want_grads):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


CSA_BACKENDS = {"reference": {}, "xla_chunked": dict(block_q=8, head_chunk=2),
                "pallas": dict(interpret=True, block_q=8)}


def _csa_grad(backend, dtype, precision="auto"):
  b, s, h, d, nw = 1, 16, 2, 8, 4
  q = jax.random.normal(jax.random.key(0), (b, s, h, d), dtype)
  k = jax.random.normal(jax.random.key(1), (b, nw, d), dtype)
  w = jax.random.normal(jax.random.key(2), (b, s, h), dtype)
  score = lambda q, k, w: ops.csa_streamindex_score(
      q, k, w, softmax_scale=d ** -0.5, compress_rate=4, backend=backend,
      precision=precision, **CSA_BACKENDS[backend])
  loss = lambda q, k, w: _score_loss(score(q, k, w))
  return lowered.pinned(jax.grad(loss, argnums=(0, 1, 2)), q, k, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", sorted(CSA_BACKENDS))
def test_the_csa_score_follows_auto(backend, dtype):
  _check_auto(_csa_grad(backend, jnp.dtype(dtype)), dtype)


@pytest.mark.parametrize("backend", sorted(CSA_BACKENDS))
def test_the_csa_score_takes_its_precision(backend):
  found = _csa_grad(backend, jnp.float32, "high")
  # The products with q or k at "high"; the XLA backends' head sums over
  # float32 relu(A) stay HIGHEST (the Pallas kernels sum elementwise).
  assert ("HIGH", "HIGH") in {m.precision for m in found}, found
  assert all(m.precision == HIGHEST for m in found
             if m.precision != ("HIGH", "HIGH")), found


def _indexer_grad(dtype, precision="auto"):
  f = hk.transform(lambda x: modules.CompressedSparseIndexer(
      num_heads=2, head_dim=8, compress_rate=4, topk=2, rope_dim=4,
      q_rank=6, precision=precision)(x).scores)
  x = jax.random.normal(jax.random.key(0), (1, T, 16), dtype)
  params = jax.tree.map(lambda p: p.astype(dtype),
                        f.init(jax.random.key(1), x))
  loss = lambda p, x: _score_loss(f.apply(p, None, x))
  return lowered.pinned(jax.grad(loss, argnums=(0, 1)), params, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_csa_indexer_follows_auto(dtype):
  _check_auto(_indexer_grad(jnp.dtype(dtype)), dtype)


def test_the_csa_indexer_takes_its_precision():
  found = _indexer_grad(jnp.float32, "default")
  assert {m.precision for m in found} == {DEFAULT, HIGHEST}, found
  # Only the score's head sums stay HIGHEST: as many as in the op alone.
  in_op = _csa_grad("reference", jnp.float32, "default")
  count = lambda ms: sum(m.precision == HIGHEST for m in ms)
  assert count(found) == count(in_op) > 0, (found, in_op)


def test_the_short_conv_has_no_matmul():
  """Its taps are W shifted multiply-adds (no dot or convolution whose
  precision could drift), forward and backward."""
  f = hk.transform(lambda x: modules.ShortConvolution(4)(x))
  x = jax.random.normal(jax.random.key(0), (2, T, 8))
  params = f.init(jax.random.key(1), x)
  grad = jax.grad(lambda p, x: jnp.sum(f.apply(p, None, x) ** 2),
                  argnums=(0, 1))
  assert lowered.matmuls(grad, params, x) == []


def test_an_unpinned_matmul_is_caught():
  a = jnp.ones((4, 4))
  conv = lambda a, **kw: jax.lax.conv_general_dilated(
      a[None, None], a[None, None], (1, 1), "SAME", **kw)
  for unpinned in (lambda a: a @ a, conv):
    with pytest.raises(AssertionError, match="take the process default"):
      lowered.pinned(lambda a: (jnp.dot(a, a, precision="highest"),
                                unpinned(a)), a)
  found = lowered.pinned(lambda a: (jnp.dot(a, a, precision="high"),
                                    conv(a, precision="highest")), a)
  assert found == [
      lowered.Matmul("dot_general", ("HIGH", "HIGH"), ("f32", "f32")),
      lowered.Matmul("convolution", HIGHEST, ("f32", "f32"))], found


def test_bad_precision_raises_value_error_naming_it():
  with pytest.raises(ValueError, match="^precision must be one of"):
    hk.transform(lambda: modules.ShortConvSoftmaxAttention(
        num_heads=2, head_dim=8, precision="fast")).init(None)
  with pytest.raises(ValueError, match="^precision must be one of"):
    hk.transform(lambda: modules.CompressedSparseIndexer(
        num_heads=2, head_dim=8, compress_rate=4, topk=2, rope_dim=4,
        precision="fast")).init(None)
  q = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match="^precision must be one of"):
    ops.csa_streamindex_score(q, jnp.ones((1, 2, 4)), jnp.ones((1, 8, 2)),
                              softmax_scale=1.0, compress_rate=4,
                              precision="fast")
  with pytest.raises(ValueError, match="^model.precision must be one of"):
    model_lib.validate_model_config(_model_config(precision="fast"), V)
  with pytest.raises(ValueError,
                     match="^model.attention: precision must be one of"):
    model_lib.validate_model_config(
        _model_config(**{"attention.precision": "fast"}), V)


def test_the_config_knows_the_op_layers_names():
  assert config_checks.PRECISIONS == precision_lib.NAMES
