"""The backend registries and the one resolver: `auto`, aliases, reasons,
the KDA decode rule, chunk sizes, errors."""

import types

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import interpret
from linear_attention import ops
from linear_attention.ops import backends
from linear_attention.ops.csa import api as csa_api
from linear_attention.ops.kda import api as kda_api

KDA = kda_api.BACKENDS


@pytest.mark.parametrize("kind,expected", [
    ("TPU v6 lite", "tokamax"), ("TPU7x", "tokamax"),
    ("TPU v5 lite", "chunked"), ("TPU v5p", "chunked"), ("TPU v4", "chunked"),
    ("cpu", "chunked"), ("NVIDIA H100 80GB HBM3", "chunked")])
def test_auto_is_tokamax_on_tpu_v6_and_newer_only(kind, expected):
  assert kda_api.resolved_backend("auto", device_kind=kind) == expected


def test_names_aliases_and_capabilities():
  assert KDA.names() == ("reference", "chunked", "tokamax", "pallas", "auto")
  # "mosaic", the name older configs and saved runs use, is tokamax.
  assert KDA.parse("mosaic") == "tokamax"
  assert kda_api.resolved_backend("mosaic") == "tokamax"
  for name in ("reference", "chunked"):
    assert kda_api.resolved_backend(name, device_kind="cpu") == name
  with pytest.raises(ValueError, match="backend must be one of") as e:
    KDA.parse("tpu")
  assert "'mosaic' is accepted for 'tokamax'" in str(e.value)
  with pytest.raises(ValueError, match="backend must be one of"):
    csa_api.BACKENDS.parse("auto")  # the CSA score has no "auto"
  # A program that may run tokamax's kernel (for "auto": on some platform)
  # traces without shard_map's check_vma; one that cannot keeps it.
  assert not kda_api.traces_under_check_vma("mosaic")
  assert not kda_api.traces_under_check_vma("auto")
  assert kda_api.traces_under_check_vma("chunked")
  assert kda_api.runs_interpreted("tokamax") == (
      jax.default_backend() != "tpu")
  assert not kda_api.runs_interpreted("chunked")


def test_supports_target_is_the_backends_own_answer():
  assert kda_api.supports_target("tokamax", "TPU v6 lite") is None
  reason = kda_api.supports_target("mosaic", "TPU v5 lite")
  assert "v6+ only" in reason and "generation 5" in reason
  assert "output 1.6e-3" in reason  # the v5e's measured reason
  assert kda_api.supports_target("chunked", "TPU v5 lite") is None


def _fake(name, reason):
  return types.SimpleNamespace(
      NAME=name, supports_target=lambda target: reason,
      supports=lambda call: reason)


def test_auto_walks_the_preference_and_reports_every_reason():
  registry = backends.Registry(
      "toy", (_fake("a", "a needs a frobnicator."), _fake("b", None),
              _fake("c", "c is too slow.")),
      aliases={"old": "b"},
      preference={"tpu": ("a", "b"), "default": ("a", "c")})
  call = types.SimpleNamespace(target=backends.Target("tpu", "TPU v6 lite"))
  assert registry.choose("auto", call.target, call) == "b"
  assert registry.resolve("old", call).NAME == "b"
  cpu = backends.Target("cpu", "cpu")
  with pytest.raises(NotImplementedError) as e:
    registry.choose("auto", cpu, types.SimpleNamespace(target=cpu))
  assert "'a': a needs a frobnicator." in str(e.value)
  assert "'c': c is too slow." in str(e.value)
  # An explicit backend that cannot run raises its own reason.
  with pytest.raises(NotImplementedError, match="c is too slow"):
    registry.resolve("c", call)
  with pytest.raises(ValueError, match="not a backend"):
    backends.Registry("toy", (_fake("a", None),), aliases={"x": "z"})


def test_decisions_are_logged_once(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "info",
                      lambda msg, *args: messages.append(msg % args))
  # A T this process has not decoded with `chunked` yet: the first decode
  # of a T in a process takes the line, and other tests decode short pieces
  # too (test_kda_gates.py T 3, the layers' prompts), in whatever order
  # xdist or tests/tpu.sh runs them.
  t = next(t for t in range(2, backends.chunk_size())
           if ("KDA decode", "chunked", t) not in backends._logged)  # pylint: disable=protected-access
  q, k, v, g, beta = _inputs(t)
  state = jnp.zeros((1, 2, 8, 8))
  for _ in range(2):
    ops.kimi_delta_attention(q, k, v, g, beta, initial_state=state,
                             backend="chunked")
  decode = [m for m in messages if f"decode piece of T={t}" in m]
  assert len(decode) == 1 and "token recurrence" in decode[0], messages
  messages.clear()
  for _ in range(2):
    backends.log_once(("a key of this test only",), "once %d", 1)
  assert messages == ["once 1"]


def test_target_and_platform_rules():
  assert backends.tpu_generation("TPU v6 lite") == 6
  assert backends.tpu_generation("TPU v5p") == 5
  assert backends.tpu_generation("TPU7x") == 7  # Ironwood's device kind
  assert backends.tpu_generation("cpu") is None
  assert backends.target("TPU v6 lite").platform == "tpu"
  assert backends.target("cpu").platform == "cpu"
  assert backends.target().platform == jax.default_backend()
  assert backends.chunk_size("cpu") == 16
  assert backends.chunk_size("gpu") == backends.chunk_size("tpu") == 64
  assert backends.chunk_size() == backends.chunk_size(jax.default_backend())


def _inputs(t, key=0):
  ks = jax.random.split(jax.random.key(key), 4)
  q, k = (jax.random.normal(k_, (1, t, 2, 8)) for k_ in ks[:2])
  v = jax.random.normal(ks[2], (1, t, 2, 8))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (1, t, 2, 8)))
  return q, k, v, g, jnp.full((1, t, 2), 0.5)


def test_the_op_runs_auto_as_the_resolved_backend():
  args = _inputs(20)
  resolved = kda_api.resolved_backend("auto")
  call = lambda backend: ops.kimi_delta_attention(*args, backend=backend)
  # "auto" is resolved before tracing: both calls are one program.
  assert _jaxpr(call, "auto") == _jaxpr(call, resolved)
  o_auto, _ = call("auto")
  o, _ = call(resolved)
  # exact: the same program (the jaxprs above) on the same inputs.
  np.testing.assert_array_equal(o_auto, o)


def _jaxpr(call, backend):
  return str(jax.make_jaxpr(lambda: call(backend))())


@pytest.mark.parametrize("t,runs", [(1, "reference"), (100, "chunked")])
def test_the_op_runs_a_decode_piece_by_the_decode_rule(t, runs):
  # A piece that continues a state: shorter than a chunk it is a decode step
  # (the token recurrence); a tokamax piece whose T is not a multiple of 64
  # runs on "chunked" (so both run here, on a host where tokamax's kernel
  # would need interpret mode).
  q, k, v, g, beta = _inputs(t, 1)
  state = jax.random.normal(jax.random.key(2), (1, 2, 8, 8))
  run = lambda backend: ops.kimi_delta_attention(
      q, k, v, g, beta, initial_state=state, output_final_state=True,
      backend=backend)
  for backend in ("mosaic", "tokamax") + (("chunked",) if t == 1 else ()):
    # The op resolves the piece before tracing: one program.
    assert _jaxpr(run, backend) == _jaxpr(run, runs), backend
    for got, want in zip(run(backend), run(runs)):
      # exact: the same program (the jaxprs above) on the same inputs.
      np.testing.assert_array_equal(got, want)


def test_a_tokamax_piece_that_is_not_a_decode_piece_raises_its_reason():
  args = _inputs(100)  # no state: not a decode piece
  with interpret.interpret_mode():
    with pytest.raises(NotImplementedError,
                       match="'tokamax' cannot run this call.*multiple of 64"):
      ops.kimi_delta_attention(*args, backend="tokamax")


@pytest.mark.parametrize("name,value", [("chunk_size", 32), ("chunk_size", 0),
                                        ("group_width", 0),
                                        ("group_width", 1.5)])
def test_bad_tuning_raises_value_error_naming_it(name, value):
  x = jnp.ones((1, 16, 1, 8))
  with pytest.raises(ValueError, match=name):
    ops.kimi_delta_attention(x, x, x, -x, jnp.full((1, 16, 1), 0.5),
                             **{name: value})
