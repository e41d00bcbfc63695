"""KimiDeltaAttention and a training step with context (and data) parallelism.

The layer applied inside shard_map with `context_axis` must give the
single-device outputs and gradients (parameters and input; relative L2
<= 1e-5, float32), and a data x context sharded training loss
(`parallel.train.shard_loss_fn`) the single-device loss and gradients.
"""

from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from linear_attention import testing
from linear_attention.modules import KimiDeltaAttention
from linear_attention.parallel import train
from tests.parallel import common

AXIS = "context"
D, H, KD, VOCAB = 16, 2, 8, 11


def layer_fn(context_axis, lower_bound, backend):
  def fwd(x, segment_ids):
    layer = KimiDeltaAttention(
        num_heads=H, head_dim=KD, lower_bound=lower_bound, backend=backend,
        context_axis=context_axis, name="kda")
    return layer(x, segment_ids=segment_ids)[0]
  return hk.without_apply_rng(hk.transform(fwd))


def flat(tree):
  return {jax.tree_util.keystr(p): v
          for p, v in jax.tree_util.tree_leaves_with_path(tree)}


class LayerContextParallelTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("cp2_chunked_lower_bound", 2, -5.0, "chunked"),
      ("cp4_reference_softplus", 4, None, "reference"),
      ("cp8_reference_softplus", 8, None, "reference"),
  )
  def test_matches_single_device(self, num_ranks, lower_bound, backend):
    rng = np.random.default_rng(num_ranks)
    x = jnp.asarray(rng.normal(size=(2, common.T, D)), jnp.float32)
    ids = jnp.asarray(common.packed_segment_ids())
    dy = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    single = layer_fn(None, lower_bound, backend)
    params = single.init(jax.random.key(0), x, ids)
    sharded_layer = layer_fn(AXIS, lower_bound, backend)
    seq = P(None, AXIS)
    sharded = jax.shard_map(
        sharded_layer.apply, mesh=common.mesh(num_ranks),
        in_specs=(P(), seq, seq), out_specs=seq)

    def loss(apply, params, x):
      y = apply(params, x, ids)
      return jnp.sum(y * dy), y

    grad = lambda apply: jax.jit(jax.grad(
        lambda p, x: loss(apply, p, x), argnums=(0, 1), has_aux=True))
    (gp, gx), y = grad(sharded)(params, x)
    (gp_ref, gx_ref), y_ref = grad(single.apply)(params, x)
    testing.assert_close(y, y_ref, rtol=1e-5, name="output")
    testing.assert_close(gx, gx_ref, rtol=1e-5, name="dx")
    gp, gp_ref = flat(gp), flat(gp_ref)
    self.assertEqual(sorted(gp), sorted(gp_ref))
    for name in gp_ref:
      testing.assert_close(gp[name], gp_ref[name], rtol=1e-5, name=name)


def model_fn(context_axis):
  """Embedding -> KimiDeltaAttention -> unembedding; token-sum cross-entropy."""
  def loss_fn(batch):
    tokens, targets, ids = batch["tokens"], batch["targets"], batch["ids"]
    x = hk.Embed(VOCAB, D, name="embed")(tokens)
    # "reference": the cheapest core to compile; the layer tests cover
    # "chunked".
    x = x + KimiDeltaAttention(num_heads=H, head_dim=KD, lower_bound=-5.0,
                               backend="reference", context_axis=context_axis,
                               name="kda")(x, segment_ids=ids)[0]
    logits = hk.Linear(VOCAB, name="unembed")(x)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    weight = (ids != 0).astype(jnp.float32)
    return jnp.sum(nll * weight), jnp.sum(weight)
  return hk.without_apply_rng(hk.transform(loss_fn))


class TrainStepTest(parameterized.TestCase):

  def test_data_x_context_step_matches_single_device(self):
    rng = np.random.default_rng(0)
    b = 4
    tokens = rng.integers(0, VOCAB, (b, common.T + 1)).astype(np.int32)
    ids = np.concatenate([common.packed_segment_ids()] * 2, axis=0)
    batch = dict(tokens=jnp.asarray(tokens[:, :-1]),
                 targets=jnp.asarray(tokens[:, 1:]), ids=jnp.asarray(ids))
    single = model_fn(None)
    params = single.init(jax.random.key(1), batch)
    mean_loss = lambda p, batch: (lambda s, w: s / w)(*single.apply(p, batch))
    mesh = common.mesh(4, ("data", "context"), shape=(2, 2))
    sharded = train.shard_loss_fn(model_fn("context").apply, mesh, "data",
                                  "context")
    step = lambda f: jax.jit(jax.value_and_grad(f))
    loss, grads = step(sharded)(params, batch)
    loss_ref, grads_ref = step(mean_loss)(params, batch)
    testing.assert_close(loss, loss_ref, rtol=1e-6, name="loss")
    grads, grads_ref = flat(grads), flat(grads_ref)
    self.assertEqual(sorted(grads), sorted(grads_ref))
    for name in grads_ref:
      testing.assert_close(grads[name], grads_ref[name], rtol=1e-5,
                           name=name)

  def test_bad_axis_rejected(self):
    mesh = common.mesh(4, ("data", "context"), shape=(2, 2))
    fn = model_fn("context").apply
    with self.assertRaisesRegex(ValueError, "context_axis must be None or"):
      train.shard_loss_fn(fn, mesh, "data", "seq")
    with self.assertRaisesRegex(ValueError, "data_axis must be None or"):
      train.shard_loss_fn(fn, mesh, 0, "context")
