"""Bytes each rank receives in KDA context parallelism, from traced shapes.

    .venv/bin/python -m benchmarks.cp_comm [--out=benchmarks/results/cp_comm.json]

For each (T, H, K, V, ranks) it traces `ops.kimi_delta_attention(...,
context_axis="context")` inside `jax.shard_map` (B = 1, packed segment ids,
backend "chunked"; nothing is compiled or run) and sums what the collectives
in the jaxpr move: an `all_gather` of an x-byte block delivers (R - 1) x
bytes to each rank, a `psum` (ring all-reduce) of x bytes 2 (R - 1) / R x.
The baseline all-gathers the sequence inputs instead (q, k, g [T, H, K],
v [T, H, V], beta [T, H], bfloat16): (R - 1) / R of all of them per rank.
"training" is the layer's call (no states in or out); "+final" also returns
the global final states (one psum of [N, H, K, V] float32, N = 4).
Prints a markdown table and writes the numbers to --out (with the commit).
"""

import argparse
import json
import os

# Simulated CPU devices for the meshes (a script, not library code).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.extend  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import kda_error_vs_length  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.tools import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from linear_attention import ops  # pylint: disable=g-import-not-at-top,wrong-import-position

AXIS = "context"
CASES = (  # (T, H, K, V, ranks)
    (4096, 16, 128, 128, 2),
    (32768, 16, 128, 128, 4),
    (65536, 16, 128, 128, 8),
    (131072, 32, 128, 256, 8),
    (8192, 2, 64, 64, 8),
)
SEQ_BYTES = 2  # bfloat16 q, k, v, g, beta


def _collective_bytes(jaxpr, ranks):
  """Bytes received per rank by the collectives in a (nested) jaxpr."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("all_gather", "psum"):
      size = sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize
                 for v in eqn.invars)
      total += size * ((ranks - 1) if name == "all_gather"
                       else 2 * (ranks - 1) / ranks)
    for sub in _sub_jaxprs(eqn.params.values()):
      total += _collective_bytes(sub, ranks)
  return total


def _sub_jaxprs(values):
  for value in values:
    if isinstance(value, jax.extend.core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
      yield value
    elif isinstance(value, (list, tuple)):
      yield from _sub_jaxprs(value)


def state_passing_bytes(t, h, kd, vd, ranks, final):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ranks]), (AXIS,))
  n = 4
  spec = P(None, AXIS)

  def op(q, k, v, g, beta, seg):
    return ops.kimi_delta_attention(
        q, k, v, g, beta, segment_ids=seg, max_num_segments=n,
        output_final_state=final, backend="chunked", context_axis=AXIS)

  f = jax.shard_map(op, mesh=mesh, in_specs=(spec,) * 6,
                    out_specs=(spec, P()), check_vma=False)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  jaxpr = jax.make_jaxpr(f)(
      s(1, t, h, kd), s(1, t, h, kd), s(1, t, h, vd), s(1, t, h, kd),
      s(1, t, h), jax.ShapeDtypeStruct((1, t), jnp.int32))
  return _collective_bytes(jaxpr.jaxpr, ranks)


def sequence_gather_bytes(t, h, kd, vd, ranks):
  per_token = h * (3 * kd + vd + 1) * SEQ_BYTES
  return t * (ranks - 1) / ranks * per_token


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/cp_comm.json",
                      type=cli.output_path)
  a = parser.parse_args()
  commit, dirty = kda_error_vs_length.git_commit()
  result = dict(commit=commit, dirty=dirty, jax=jax.__version__,
                segments=4, sequence_bytes_per_element=SEQ_BYTES, rows=[])
  print("| T | H | K | V | ranks | state passing, training | +final states"
        " | all-gather of q,k,v,g,beta (bf16) | ratio (training) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for t, h, kd, vd, ranks in CASES:
    train = state_passing_bytes(t, h, kd, vd, ranks, final=False)
    final = state_passing_bytes(t, h, kd, vd, ranks, final=True)
    seq = sequence_gather_bytes(t, h, kd, vd, ranks)
    mib = lambda x: f"{x / 2**20:.2f} MiB"
    print(f"| {t} | {h} | {kd} | {vd} | {ranks} | {mib(train)} |"
          f" {mib(final)} | {mib(seq)} | {seq / train:.0f}x |")
    result["rows"].append(dict(
        t=t, h=h, k=kd, v=vd, ranks=ranks, state_passing_bytes=float(train),
        with_final_states_bytes=float(final),
        sequence_all_gather_bytes=float(seq), ratio=float(seq / train)))
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run_script(main)
