"""`KimiDeltaAttention`: the Kimi Linear token mixer as a Haiku module.

Kimi Linear (arXiv 2510.26692, §4; fla `fla/layers/kda.py`). For x [B, T, D]:

    q, k, v = SiLU(ShortConv(x W_q)), SiLU(ShortConv(x W_k)), SiLU(ShortConv(x W_v))
    g_raw   = (x W_f_down) W_f_up                 low rank, rank = head_dim
    beta    = sigmoid(x W_b)                      one per value head
              (2 sigmoid(x W_b) with allow_neg_eigval)
    o, S    = KDA(l2norm(q), l2norm(k), v, g_raw, beta; a_log, dt_bias)
    y       = (RMSNorm_head(o) * sigmoid((x W_g_down) W_g_up)) W_o

with, inside the op, the gate g = -exp(a_log) * softplus(g_raw + dt_bias), or
with `lower_bound`, g = lower_bound * sigmoid(exp(a_log) * (g_raw + dt_bias)),
and per head S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} +
beta_t k_t v_t^T, o_t = S_t^T (K^-1/2 q_t).

Glossary of shapes: B batch, T time, D model width (from the input), H heads
of q and k, HV = num_v_heads value heads (default H; a multiple of H, value
head j reading q/k head j // (HV / H)), K = head_dim, V = head_dim *
expand_v, W = conv_size. The gate, beta, the state and the output norm and
gate are per value head, as in flash-linear-attention's `num_v_heads`.

Choices written down here:
* Projections are bias-free, weights N(0, 0.02) (`hk.initializers.
  RandomNormal`, not truncated). The output gate has no bias (the paper's
  equation and HF Kimi; fla adds one on the up projection).
* Short-conv taps U(-1/sqrt(W), 1/sqrt(W)) (PyTorch's Conv1d default, kept
  by fla), no conv bias; see `ShortConvolution`.
* a_log [H] = log U(1, 16) for the softplus gate, zeros with `lower_bound`;
  dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4, dt_bias = dt +
  log(-expm1(-dt)) (the inverse softplus of dt).
* decay="head" is Gated DeltaNet's gate: one full-rank projection D -> HV
  (`f_proj`, like GDN's `a_proj`), a_log [HV], dt_bias [HV], broadcast over K
  inside the layer before the op.
* allow_neg_eigval=True (Grazzi et al., arXiv 2411.12537) doubles beta, so
  the transition I - beta k k^T has eigenvalues in (-1, 1]: what lets a
  linear recurrence track state such as parity (`experiments/tasks/
  parity.py`).
* The backend is the op's decision: the layer passes `backend` through, and
  with backend="tokamax" the op runs decode pieces whose T is not a multiple
  of 64 on "chunked" (logged once); the kernel needs T % 64 == 0.
"""

import dataclasses
import math
from typing import NamedTuple

import chex
import haiku as hk
import jax
import jax.numpy as jnp

from linear_attention.modules import mixer
from linear_attention.modules import norms
from linear_attention.modules import pinned
from linear_attention.modules import short_conv
from linear_attention.ops import checks
from linear_attention.ops import precision as precision_lib
from linear_attention.ops.kda import api as kda_api

DECAYS = ("channel", "head")
WEIGHT_STDDEV = 0.02


def validate_kda_layer_args(
    *,
    num_heads: int,
    head_dim: int,
    expand_v: float = 1.0,
    conv_size: int = 4,
    lower_bound: float | None = None,
    backend: str = "chunked",
    decay: str = "channel",
    use_output_gate: bool = True,
    context_axis: str | None = None,
    num_v_heads: int | None = None,
    allow_neg_eigval: bool = False,
    chunk_size: int | None = None,
    precision: str = "auto",
) -> None:
  """Raises ValueError, naming the argument, unless the layer can be built."""
  checks.mesh_axis_name("context_axis", context_axis)
  checks.int_at_least("num_heads", num_heads, 1)
  checks.int_at_least("head_dim", head_dim, 1)
  if not (checks.is_number(expand_v) and math.isfinite(expand_v)
          and expand_v > 0
          and head_dim * expand_v == round(head_dim * expand_v)):
    raise ValueError(
        f"expand_v must be a positive number with head_dim * expand_v a"
        f" whole number (the value head dim); got expand_v={expand_v!r} with"
        f" head_dim={head_dim}.")
  checks.int_at_least("conv_size", conv_size, 0,
                      note=" (0 turns the short conv off)")
  kda_api.validate_lower_bound(lower_bound)
  kda_api.BACKENDS.parse(backend)
  checks.one_of("decay", decay, DECAYS)
  checks.boolean("use_output_gate", use_output_gate)
  if num_v_heads is not None and not (
      checks.is_int(num_v_heads) and num_v_heads >= 1
      and num_v_heads % num_heads == 0):
    raise ValueError(
        f"num_v_heads must be None or a positive multiple of num_heads ="
        f" {num_heads}; got {num_v_heads!r}.")
  checks.boolean("allow_neg_eigval", allow_neg_eigval)
  checks.one_of("chunk_size", chunk_size, kda_api.CHUNK_SIZES, optional=True)
  precision_lib.validate(precision)


class KDACache(NamedTuple):
  """Decode cache of one `KimiDeltaAttention` layer (zeros = a new sequence).

  q_conv, k_conv: [B, W - 1, H*K] and v_conv: [B, W - 1, HV*V], the last
    W - 1 projected inputs of each short conv, in the activations' dtype
    (width 0 when conv_size <= 1).
  state: [B, HV, K, V] float32 recurrent state S.
  """
  q_conv: jax.Array
  k_conv: jax.Array
  v_conv: jax.Array
  state: jax.Array


def init_kda_cache(batch_size: int, *, num_heads: int, head_dim: int,
                   expand_v: float = 1.0, conv_size: int = 4,
                   num_v_heads: int | None = None,
                   dtype=jnp.float32) -> KDACache:
  """An all-zero `KDACache` (usable outside `hk.transform`)."""
  h, kd, vd = num_heads, head_dim, int(round(head_dim * expand_v))
  hv = num_v_heads or h
  tail = max(conv_size - 1, 0)
  return KDACache(
      q_conv=jnp.zeros((batch_size, tail, h * kd), dtype),
      k_conv=jnp.zeros((batch_size, tail, h * kd), dtype),
      v_conv=jnp.zeros((batch_size, tail, hv * vd), dtype),
      state=jnp.zeros((batch_size, hv, kd, vd), jnp.float32))


def _a_log_init(shape, dtype):
  """log U(1, 16)."""
  return jnp.log(jax.random.uniform(hk.next_rng_key(), shape, dtype, 1.0, 16.0))


def _dt_bias_init(shape, dtype):
  """Inverse softplus of dt = exp(U(log 1e-3, log 1e-1)), dt >= 1e-4."""
  u = jax.random.uniform(hk.next_rng_key(), shape, dtype,
                         math.log(1e-3), math.log(1e-1))
  dt = jnp.maximum(jnp.exp(u), 1e-4)
  return dt + jnp.log(-jnp.expm1(-dt))


def _tails_at_boundaries(projected, segment_ids, every, conv_size):
  """[B, T, C] conv inputs -> [B, T // every, W - 1, C] cache tails.

  Tail j holds the inputs at the W - 1 positions up to token (j + 1) every
  - 1, zeros before the sequence start, in other documents, and where that
  token is padding: what a prefill of the first (j + 1) every tokens leaves
  in the short conv's cache.
  """
  b, t, c = projected.shape
  n, width = t // every, max(conv_size - 1, 0)
  last = (jnp.arange(n) + 1) * every - 1  # [J]
  pos = last[:, None] - width + 1 + jnp.arange(width)[None, :]  # [J, W-1]
  tails = projected[:, jnp.clip(pos, 0)]  # [B, J, W-1, C]
  keep = jnp.broadcast_to(pos >= 0, (b,) + pos.shape)
  if segment_ids is not None:
    ids = jnp.asarray(segment_ids)
    at_last = ids[:, last][:, :, None]  # [B, J, 1]
    keep = keep & (ids[:, jnp.clip(pos, 0)] == at_last) & (at_last != 0)
  return jnp.where(keep[..., None], tails, 0).astype(projected.dtype)


@dataclasses.dataclass(kw_only=True)
class KimiDeltaAttention(hk.Module):
  """Kimi Delta Attention layer: [B, T, D] -> [B, T, D] (see module docstring).

  Call as `layer(x, segment_ids=ids)` -> (y, None), or `layer(x,
  cache=cache)` -> (y, new_cache) to continue a sequence (prefill, then
  decode steps): the mixer contract (`modules/mixer.py`);
  `layer.chunk_caches(x, every=C)` also gives the caches at every C-th
  token.
  """

  num_heads: int  # H, the number of heads.
  head_dim: int  # K, the query/key head dim; also the rank of both gates.
  expand_v: float = 1.0  # value head dim V = head_dim * expand_v.
  conv_size: int = 4  # W taps of the short conv; 0 = no conv, SiLU only.
  lower_bound: float | None = None  # None: softplus gate; else in [-5, 0).
  # KDA core: a name of `linear_attention.ops.kda.api.BACKENDS`
  # ("reference", "chunked", "tokamax", "pallas", "auto"; "mosaic" = "tokamax").
  backend: str = "chunked"
  # Mesh axis T is split over when called inside jax.shard_map (context
  # parallelism; passed to the short convs and the op), or None.
  context_axis: str | None = None
  decay: str = "channel"  # "channel" (KDA) or "head" (Gated DeltaNet).
  use_output_gate: bool = True  # sigmoid low-rank gate on the output.
  num_v_heads: int | None = None  # HV value heads (multiple of H); None: H.
  allow_neg_eigval: bool = False  # beta = 2 sigmoid(.): eigenvalues (-1, 1].
  chunk_size: int | None = None  # "chunked" backend's chunk; None: platform's.
  # Matmul precision of the op and the projections ("auto": float32-exact
  # for float32 activations, one bfloat16 pass for bfloat16; see
  # linear_attention/ops/precision.py).
  precision: str = "auto"
  name: str | None = None  # Haiku module name.

  def __post_init__(self):
    validate_kda_layer_args(
        num_heads=self.num_heads, head_dim=self.head_dim,
        expand_v=self.expand_v, conv_size=self.conv_size,
        lower_bound=self.lower_bound, backend=self.backend, decay=self.decay,
        use_output_gate=self.use_output_gate,
        context_axis=self.context_axis, num_v_heads=self.num_v_heads,
        allow_neg_eigval=self.allow_neg_eigval, chunk_size=self.chunk_size,
        precision=self.precision)
    super().__post_init__()  # hk.Module.__init__(name=self.name)

  @property
  def value_dim(self) -> int:
    """V = head_dim * expand_v."""
    return int(round(self.head_dim * self.expand_v))

  @property
  def value_heads(self) -> int:
    """HV = num_v_heads, or num_heads when unset."""
    return self.num_v_heads or self.num_heads

  def init_cache(self, batch_size: int, max_len: int | None = None,
                 dtype=jnp.float32) -> KDACache:
    """Zeros: the cache before the first token; dtype of the conv tails.
    `max_len` is not needed: the state has one size at any length."""
    del max_len
    return init_kda_cache(
        batch_size, num_heads=self.num_heads, head_dim=self.head_dim,
        expand_v=self.expand_v, conv_size=self.conv_size,
        num_v_heads=self.num_v_heads, dtype=dtype)

  @hk.transparent  # no extra name scope: params are `<layer>/q_proj/w`, ...
  def _linear(self, size, name):
    """x -> x W, at the layer's precision for x's dtype."""
    return lambda x: pinned.linear(
        x, size, precision=self.precision, name=name,
        w_init=hk.initializers.RandomNormal(WEIGHT_STDDEV))

  @hk.transparent
  def _conv_silu(self, x, name, segment_ids, tail):
    """SiLU(ShortConv(x)); with a cache tail also returns the new tail."""
    if self.conv_size == 0:
      y = jax.nn.silu(x)
      return y if tail is None else (y, tail)
    conv = short_conv.ShortConvolution(self.conv_size, activation="silu",
                                       name=name)
    return conv(x, segment_ids=segment_ids, cache=tail,
                context_axis=self.context_axis)

  def _check_cache(self, cache, batch):
    want = self.init_cache(batch)
    for field, have, ref in zip(KDACache._fields, cache, want):
      if tuple(have.shape) != tuple(ref.shape):
        raise ValueError(
            f"cache.{field} must have shape {tuple(ref.shape)} for this layer"
            f" and batch {batch}; got {tuple(have.shape)}.")

  def __call__(
      self, x: jax.Array, *, segment_ids: jax.Array | None = None,
      cache: KDACache | None = None, max_num_segments: int | None = None,
  ) -> tuple[jax.Array, KDACache | None]:
    """Applies the layer (the mixer contract, `modules/mixer.py`).

    Args:
      x: [B, T, D] inputs.
      segment_ids: [B, T] int, 1-indexed packed documents, 0 = padding; no
        information crosses a document boundary (conv and core). With a
        `cache`, every non-zero id is the row's one document continuing the
        cache (use 0 for padding). Padding outputs zero.
      cache: a `KDACache` to continue from (`init_cache` for a new sequence).
      max_num_segments: static bound on the documents per row, passed to the
        op (which needs it only with states).

    Returns:
      (y [B, T, D] in x.dtype, the new cache; None without `cache`).
    """
    return self._apply(x, segment_ids, cache, max_num_segments, None)

  @hk.name_like("__call__")  # the same parameters as a call
  def chunk_caches(
      self, x: jax.Array, *, every: int, segment_ids: jax.Array | None = None,
      max_num_segments: int | None = None,
  ) -> tuple[jax.Array, KDACache]:
    """The layer on a prefill from the start, and its decode caches at every
    `every`-th token (prefix caching).

    Args:
      x, segment_ids, max_num_segments: as `__call__` (no cache).
      every: C >= 1. Under `context_axis`, C must be >= W - 1 and divide
        each rank's T.

    Returns:
      (y [B, T, D], a `KDACache` whose fields have a boundary axis after B:
      q_conv [B, T // C, W - 1, H*K], ..., state [B, T // C, HV, K, V]);
      entry j continues the sequence after token (j + 1) C - 1 exactly like
      the cache a prefill of those tokens returns (its document only; zeros
      where that token is padding). The recurrent states come from the op's
      `output_chunk_states` (every backend but "tokamax").
    """
    checks.int_at_least("every", every, 1)
    return self._apply(x, segment_ids, None, max_num_segments, every)

  @hk.transparent
  def _apply(self, x, segment_ids, cache, max_num_segments, every):
    """(y, new cache | chunk caches | None); see the two public methods."""
    checks.rank("x", x, 3, "[B, T, D]")
    b, t, d = x.shape
    cached = cache is not None
    self._check_call(every)
    if cached:
      self._check_cache(cache, b)
      if segment_ids is not None:  # one document per row, 0 = padding
        segment_ids = (segment_ids != 0).astype(jnp.int32)
    (q, k, v), projected, new_tails = self._qkv(x, segment_ids, cache)
    g, a_log, dt_bias, beta = self._gate_and_beta(x)
    initial_state = None
    if cached:
      initial_state = cache.state
      if segment_ids is not None:  # ids are 0/1 here: one state per row
        initial_state, max_num_segments = cache.state[:, None], 1
    chunk_states = ({} if every is None else
                    dict(output_chunk_states=True, chunk_states_every=every))
    outs = kda_api.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        lower_bound=self.lower_bound, use_gate_in_kernel=True,
        use_qk_l2norm=True, initial_state=initial_state,
        output_final_state=cached, segment_ids=segment_ids,
        max_num_segments=max_num_segments,
        allow_neg_eigval=self.allow_neg_eigval, backend=self.backend,
        context_axis=self.context_axis, chunk_size=self.chunk_size,
        precision=self.precision, **chunk_states)
    o, state = outs[:2]
    chex.assert_shape(o, (b, t, self.value_heads, self.value_dim))
    y = self._output(x, o)
    if every is not None:
      tails = [_tails_at_boundaries(p, segment_ids, every, self.conv_size)
               for p in projected]
      return y, KDACache(*tails, state=outs[2].astype(jnp.float32))
    if not cached:
      return y, None
    if segment_ids is not None:
      state = state[:, 0]
    new_tails = [n.astype(c.dtype) for n, c in zip(new_tails, cache)]
    new_cache = KDACache(*new_tails, state=state.astype(jnp.float32))
    chex.assert_trees_all_equal_shapes(new_cache, cache)
    return y, new_cache

  def _check_call(self, every):
    """ValueError for an `every` this call cannot honour."""
    if every is None:
      return
    if self.context_axis is not None and every < self.conv_size - 1:
      raise ValueError(
          f"every ({every}) must be >= conv_size - 1"
          f" ({self.conv_size - 1}) under context_axis.")

  @hk.transparent
  def _qkv(self, x, segment_ids, cache):
    """(q, k, v) per head, the projections before the convs, the new tails."""
    b, t, _ = x.shape
    h, kd, vd, hv = (self.num_heads, self.head_dim, self.value_dim,
                     self.value_heads)
    tails = cache[:3] if cache is not None else (None, None, None)
    out, new_tails, projected = [], [], []
    for name, size, tail in zip("qkv", (h * kd, h * kd, hv * vd), tails):
      y = self._linear(size, f"{name}_proj")(x)
      projected.append(y)
      y = self._conv_silu(y, f"{name}_conv1d", segment_ids, tail)
      if cache is not None:
        y, tail = y
        new_tails.append(tail)
      out.append(y)
    heads = (h, h, hv)
    dims = (kd, kd, vd)
    qkv = tuple(y.reshape(b, t, n, e) for y, n, e in zip(out, heads, dims))
    return qkv, projected, new_tails

  @hk.transparent
  def _gate_and_beta(self, x):
    """The raw gate [B, T, HV, K], a_log, dt_bias [HV * K] and beta."""
    b, t, _ = x.shape
    kd, hv, f32 = self.head_dim, self.value_heads, jnp.float32
    if self.decay == "channel":
      g = self._linear(hv * kd, "f_b_proj")(self._linear(kd, "f_a_proj")(x))
      g = g.reshape(b, t, hv, kd)
      bias_shape = (hv * kd,)
    else:  # "head": Gated DeltaNet's scalar decay, broadcast over K
      g = self._linear(hv, "f_proj")(x)
      g = jnp.broadcast_to(g[..., None], (b, t, hv, kd))
      bias_shape = (hv,)
    a_log_init = jnp.zeros if self.lower_bound is not None else _a_log_init
    a_log = hk.get_parameter("a_log", (hv,), f32, init=a_log_init)
    dt_bias = hk.get_parameter("dt_bias", bias_shape, f32, init=_dt_bias_init)
    if self.decay == "head":
      dt_bias = jnp.repeat(dt_bias, kd)  # [HV] -> [HV*K]
    beta = jax.nn.sigmoid(self._linear(hv, "b_proj")(x).astype(f32))
    if self.allow_neg_eigval:
      beta = 2.0 * beta
    return g, a_log, dt_bias, beta

  @hk.transparent
  def _output(self, x, o):
    """y = (RMSNorm_head(o) * output gate) W_o, [B, T, D] in x.dtype."""
    b, t, d = x.shape
    hv, kd, vd = self.value_heads, self.head_dim, self.value_dim
    o = norms.RMSNorm(name="o_norm")(o).reshape(b, t, hv * vd)
    if self.use_output_gate:
      gate = self._linear(hv * vd, "g_b_proj")(self._linear(kd, "g_a_proj")(x))
      o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    y = self._linear(d, "o_proj")(o).astype(x.dtype)
    chex.assert_shape(y, (b, t, d))
    return y


def _cache(batch_size, max_len, keywords) -> KDACache:
  """`init_kda_cache` from the layer's keyword arguments."""
  del max_len  # one size at any length
  return init_kda_cache(batch_size, **{
      name: keywords[name] for name in ("num_heads", "head_dim", "expand_v",
                                        "conv_size", "num_v_heads")
      if name in keywords})


_KDA_CAPABILITIES = mixer.Capabilities(
    recurrent_state=True, op_backend=True, context_parallel=True)
# Kimi Delta Attention (config name "kda"), and Gated DeltaNet ("gdn"): the
# same layer with one decay per head (decay="head"), from the same section.
MIXER = mixer.Mixer(
    name="kda", section="kda",
    build=lambda keywords, name: KimiDeltaAttention(**keywords, name=name),
    init_cache=_cache,
    validate=lambda keywords: validate_kda_layer_args(**keywords),
    capabilities=_KDA_CAPABILITIES)
GDN_MIXER = dataclasses.replace(MIXER, name="gdn", fixed={"decay": "head"})
