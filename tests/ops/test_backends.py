"""The one backend policy: `auto`, the decode fallback, chunk sizes, errors."""

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import ops
from linear_attention.ops import backend_enum
from linear_attention.ops import backends
from linear_attention.ops.backends import Backend


@pytest.mark.parametrize("kind,expected", [
    ("TPU v6 lite", Backend.MOSAIC), ("TPU7x", Backend.MOSAIC),
    ("TPU v5p", Backend.CHUNKED), ("TPU v4", Backend.CHUNKED),
    ("cpu", Backend.CHUNKED), ("NVIDIA H100 80GB HBM3", Backend.CHUNKED)])
def test_auto_is_mosaic_on_tpu_v6_and_newer_only(kind, expected):
  assert backends.resolve("auto", device_kind=kind) is expected


def test_explicit_choices_are_kept_and_decode_falls_back_logged(
    monkeypatch):
  for name in ("reference", "chunked", "mosaic"):
    assert backends.resolve(name, device_kind="cpu") is Backend(name)
  messages = []
  monkeypatch.setattr(logging, "info",
                      lambda msg, *args: messages.append(msg % args))
  assert backends.resolve("mosaic", decode_len=128) is Backend.MOSAIC
  assert backends.resolve("mosaic", decode_len=100) is Backend.CHUNKED
  assert backends.resolve("mosaic", decode_len=1) is Backend.REFERENCE
  assert backends.resolve("mosaic", decode_len=1) is Backend.REFERENCE
  assert backends.resolve("chunked", decode_len=1) is Backend.REFERENCE
  assert backends.resolve("chunked", decode_len=100) is Backend.CHUNKED
  # Logged at most once per (requested backend, T) in a process (another
  # test may have logged these already), and saying what runs instead.
  fallbacks = [m for m in messages if "T=1 " in m]
  assert len(fallbacks) <= 2 and len(set(fallbacks)) == len(fallbacks)
  assert all("token recurrence" in m for m in fallbacks)
  messages.clear()
  for _ in range(2):
    backend_enum.log_once(("a key of this test only",), "once %d", 1)
  assert messages == ["once 1"]


def test_bad_names_and_platform_rules():
  with pytest.raises(ValueError, match="backend must be one of"):
    backends.resolve("tpu")
  assert backends.tpu_generation("TPU v6 lite") == 6
  assert backends.tpu_generation("TPU v5p") == 5
  assert backends.tpu_generation("TPU7x") == 7  # Ironwood's device kind
  assert backends.tpu_generation("cpu") is None
  assert backends.chunk_size("cpu") == 16
  assert backends.chunk_size("gpu") == backends.chunk_size("tpu") == 64
  assert backends.chunk_size() == backends.chunk_size(jax.default_backend())


def test_the_op_runs_auto_as_the_resolved_backend():
  ks = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(key, (1, 20, 2, 8)) for key in ks[:2])
  v = jax.random.normal(ks[2], (1, 20, 2, 8))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (1, 20, 2, 8)))
  beta = jnp.full((1, 20, 2), 0.5)
  resolved = backends.resolve("auto").value
  call = lambda backend: ops.kimi_delta_attention(q, k, v, g, beta,
                                                  backend=backend)
  # "auto" is resolved before tracing: both calls are one program.
  assert _jaxpr(call, "auto") == _jaxpr(call, resolved)
  o_auto, _ = call("auto")
  o, _ = call(resolved)
  # exact: the same program (the jaxprs above) on the same inputs.
  np.testing.assert_array_equal(o_auto, o)


def _jaxpr(call, backend):
  return str(jax.make_jaxpr(lambda: call(backend))())


def test_the_op_runs_a_decode_step_as_the_token_recurrence():
  # A piece that continues a state and is shorter than a chunk is a decode
  # step: the op itself runs it as the token recurrence, for "mosaic" too
  # (so it runs here, on a host where Mosaic would need interpret mode).
  ks = jax.random.split(jax.random.key(1), 5)
  q, k, v = (jax.random.normal(key, (2, 1, 2, 8)) for key in ks[:3])
  g = -jax.nn.softplus(jax.random.normal(ks[3], (2, 1, 2, 8)))
  beta = jnp.full((2, 1, 2), 0.5)
  state = jax.random.normal(ks[4], (2, 2, 8, 8))
  run = lambda backend: ops.kimi_delta_attention(
      q, k, v, g, beta, initial_state=state, output_final_state=True,
      backend=backend)
  for backend in ("mosaic", "chunked"):
    # The op resolves the step to "reference" before tracing: one program.
    assert _jaxpr(run, backend) == _jaxpr(run, "reference"), backend
    for got, want in zip(run(backend), run("reference")):
      # exact: the same program (the jaxprs above) on the same inputs.
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name,value", [("chunk_size", 32), ("chunk_size", 0),
                                        ("group_width", 0),
                                        ("group_width", 1.5)])
def test_bad_tuning_raises_value_error_naming_it(name, value):
  x = jnp.ones((1, 16, 1, 8))
  with pytest.raises(ValueError, match=name):
    ops.kimi_delta_attention(x, x, x, -x, jnp.full((1, 16, 1), 0.5),
                             **{name: value})
