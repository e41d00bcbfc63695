r"""The kernels' static schedules for a TPU v5e, compiled on any host.

    python -m benchmarks.kda_kernel_bundles --out=DIR --libtpu=PATH/libtpu.so
    make bundles    # fetches the locked libtpu into .libtpu/ and runs this

libtpu compiles for a TPU it does not have (JAX's compile-only topologies,
`jax.experimental.topologies`): the same Mosaic and XLA passes as on the
chip, down to the VLIW bundles the TensorCore issues. With
`--xla_jf_dump_to` it writes each program's schedule analysis; this reads
the total of scheduled bundles of every kernel (`pallas_call`) in the
configurations below, which are `kda_tpu_profile.py`'s implementations of
the same names, forward and backward (`fwd_bwd`), at the shapes the chip
timed. A grid step runs the kernel's body once, so bundles x grid steps is
the kernel's issue cycles when nothing stalls: against the chip's measured
kernel times (docs/kernel.md) that is the clock, and a change to the kernel
can be weighed here before a chip times it. Each row also holds libtpu's
slot-uses per unit (slots a bundle and uses in all: the matrix units,
the vector ALUs, loads, stores and, among them, register spills and
fills), so uses / slots is the fewest bundles that unit alone needs.

It also compiles the op's `pallas` backend forward and backward for the
v5e in each form it takes (`VARIANTS`: T not a multiple of the chunk,
float32, packed segments with and without per-segment states,
chunk-boundary states), each row "compiled" or the compiler's error: a
layout or an operation Mosaic cannot lower fails here, not on a chip.

`--source=CHECKOUT` compiles the kernels of another checkout of this
repository (its `linear_attention`; the configurations and this script
stay this one's), so that a commit the chip timed can be counted with the
same script. Writes DIR/kda_kernel_bundles.json (the libtpu and JAX
versions, the source's commit, rows).
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from experiments.tools import cli

# (name, shape B T H K, dtype, kda_tpu_profile implementation, precision)
CONFIGS = (
    ("bf16_hb16", (1, 8192, 32, 128), "bfloat16", "batched_hb16_fused",
     "auto"),
    ("bf16_strided", (1, 8192, 32, 128), "bfloat16", "batched_strided_fused",
     "auto"),
    ("bf16_hb16_b8", (8, 4096, 16, 128), "bfloat16", "batched_hb16_fused",
     "auto"),
    ("f32_high", (1, 8192, 32, 128), "float32", "batched_fused", "high"),
    # Heads a step: 8, 4 and all 32 against the 16 above.
    ("bf16_hb8", (1, 8192, 32, 128), "bfloat16", "batched_hb8_fused", "auto"),
    ("bf16_hb4", (1, 8192, 32, 128), "bfloat16", "batched_hb4_fused", "auto"),
    ("bf16_hball", (1, 8192, 32, 128), "bfloat16", "batched_hball_fused",
     "auto"),
)
# (name, B, T, H, dtype, op keywords): the op's forms on backend "pallas".
VARIANTS = (
    ("padded_t1000", 2, 1000, 16, "bfloat16", dict(output_final_state=True)),
    ("float32_auto", 1, 2048, 16, "float32", dict(output_final_state=True)),
    ("packed_segments", 2, 4096, 16, "bfloat16", dict(segments=True)),
    ("per_segment_states", 2, 4096, 16, "bfloat16",
     dict(segments=True, max_num_segments=4, output_final_state=True)),
    ("chunk_states_1024", 1, 8192, 16, "bfloat16",
     dict(output_chunk_states=True, chunk_states_every=1024,
          output_final_state=True)),
    ("chunk_states_64", 1, 2048, 16, "bfloat16",
     dict(output_chunk_states=True, chunk_states_every=64,
          output_final_state=True)),
    ("float32_packed_segments", 2, 2048, 16, "float32", dict(segments=True)),
)
_SCHEDULE = re.compile(r"^\d+-(.+)-\d+-schedule-analysis_final_bundles\.txt$")
_UNITS = re.compile(
    r"^\d+-(.+)-\d+-final_hlo-static-per-bundle-utilization\.txt$")


def _git(source, *args):
  try:
    return subprocess.run(["git", "-C", source, *args], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def drain(dump):
  """{program: (bundles, units)} from the schedule analyses and per-bundle
  utilizations libtpu wrote to `dump`, whose files are then removed (the
  next compile's programs may have the same names). units: {unit: (slots
  a bundle, slot-uses in all)} (the matrix units, the vector ALUs, loads,
  stores, spills and fills, ...), or {} without a utilization file."""
  bundles, used = {}, {}
  for name in sorted(os.listdir(dump)):
    path = os.path.join(dump, name)
    schedule, utilization = _SCHEDULE.match(name), _UNITS.match(name)
    if schedule:
      with open(path) as fh:
        total = re.search(r"total scheduled bundles:\s+(\d+)", fh.read())
      if total:
        bundles[schedule[1]] = int(total[1])
    elif utilization:
      with open(path) as fh:
        lines = fh.read().split("\n")
      names = [x.strip() for x in lines[1].split(",")]
      slots = [int(x) for x in lines[2].split()]
      totals = [0] * len(names)
      for line in lines[4:]:
        for i, x in enumerate(line.split()):
          totals[i] += int(x)
      used[utilization[1]] = {n: (c, t)
                              for n, c, t in zip(names, slots, totals)}
    if os.path.isfile(path):
      os.remove(path)
  return {p: (n, used.get(p, {})) for p, n in bundles.items()}


def _grids(jaxpr):
  """The grid of every pallas_call in `jaxpr`, in order."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(tuple(eqn.params["grid_mapping"].grid))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += _grids(sub)
  return found


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="kda_kernel_bundles",
                 type=cli.output_folder)
  p.add_argument("--libtpu", default=None,
                 help="libtpu.so (default: the installed libtpu package's)")
  p.add_argument("--source", default=None,
                 help="a checkout whose linear_attention is compiled")
  p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
  a = p.parse_args()
  names = a.configs.split(",")
  known = [c[0] for c in CONFIGS]
  if any(n not in known for n in names):
    p.error(f"--configs: of {', '.join(known)}; got {a.configs!r}")
  libtpu = a.libtpu
  if libtpu is None:
    spec = importlib.util.find_spec("libtpu")
    if spec is None:
      p.error("--libtpu: no libtpu package installed; pass the path of a"
              " libtpu.so (`make bundles` fetches the locked one)")
    libtpu = os.path.join(os.path.dirname(spec.origin), "libtpu.so")
  if not os.path.isfile(libtpu):
    p.error(f"--libtpu: no file {libtpu!r}")
  dump = tempfile.mkdtemp(prefix="kda_kernel_bundles_")
  # Read when libtpu loads (below, at the first topology).
  os.environ["TPU_LIBRARY_PATH"] = libtpu
  os.environ["LIBTPU_INIT_ARGS"] = (
      os.environ.get("LIBTPU_INIT_ARGS", "") + f" --xla_jf_dump_to={dump}")
  source = os.path.abspath(a.source or os.getcwd())
  if a.source:  # its linear_attention, this checkout's everything else
    sys.path.insert(0, source)
    importlib.import_module("linear_attention")
    sys.path.remove(source)
    if not sys.modules["linear_attention"].__file__.startswith(source):
      p.error(f"--source: {source} has no linear_attention package")

  # pylint: disable=g-import-not-at-top
  import jax
  jax.config.update("jax_platforms", "cpu")  # no TPU here: compile only
  from jax.experimental import topologies
  import jax.numpy as jnp
  from benchmarks import kda_tpu_profile as profile
  from linear_attention.ops.kda import mosaic

  topology = topologies.get_topology_desc("v5e=1x1", platform="tpu")
  mesh = jax.sharding.Mesh(topology.devices[0:1], ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = []
  drain(dump)
  for name, (b, t, h, d), dtype, impl, precision in CONFIGS:
    if name not in names:
      continue
    start = time.monotonic()
    dt = jnp.dtype(dtype)
    arg = lambda shape, dt=dt: jax.ShapeDtypeStruct(shape, dt,
                                                    sharding=sharding)
    f32 = jnp.dtype(jnp.float32)
    args = [arg((b, t, h, d))] * 4 + [arg((b, t, h)), arg((h,), f32),
                                      arg((h * d,), f32)]
    fn = profile.with_pass(profile.implementation(
        impl, precision=profile.parse_precision(precision)), "fwd_bwd")
    with mosaic.lowering_mode("v5e", mesh=mesh):
      traced = jax.jit(fn).trace(*args)
      lowered = traced.lower()
    lowered.compile()
    grids = _grids(traced.jaxpr.jaxpr)
    found = drain(dump)
    kernels = [k for k in found
               if re.search(r"_forward|_backward|_kernel", k)]
    if len(kernels) != len(grids):
      raise RuntimeError(f"{name}: {len(grids)} pallas_calls, schedules of"
                         f" {kernels}")
    for kernel, grid in zip(kernels, grids):  # forward first, as traced
      steps = 1
      for n in grid:
        steps *= n
      n, used = found[kernel]
      rows.append(dict(config=name, shape=[b, t, h, d], dtype=dtype,
                       impl=impl, precision=precision, kernel=kernel,
                       bundles=n, grid=list(grid), grid_steps=steps,
                       cycles=n * steps,
                       units={u: dict(slots=c, uses=n)
                              for u, (c, n) in used.items()}))
      busiest = ", ".join(f"{u} {n / c:.0f}" for u, (c, n) in sorted(
          used.items(), key=lambda x: -x[1][1] / x[1][0])[:3])
      print(f"{name:>13} {kernel:>34}: {n:>6} bundles x"
            f" {steps:>5} steps = {n * steps / 1e6:.3f} M"
            f" cycles; fullest units (bundles): {busiest}"
            f" ({time.monotonic() - start:.0f} s)", flush=True)
  variants = []
  for name, b, t, h, dtype, kw in VARIANTS:
    variants.append(dict(variant=name, shape=[b, t, h, 128], dtype=dtype,
                         result=_compile_variant(b, t, h, dtype, kw,
                                                 sharding, mesh)))
    drain(dump)
    print(f"{name:>24}: {variants[-1]['result'][:300]}", flush=True)
  report = dict(
      chip="TPU v5e (compile-only topology v5e=1x1)", jax=jax.__version__,
      libtpu=_libtpu_version(libtpu), source=source,
      source_commit=_git(source, "rev-parse", "HEAD"),
      source_dirty=bool(_git(source, "status", "--porcelain",
                             "linear_attention")),
      script_commit=_git(os.getcwd(), "rev-parse", "HEAD"), rows=rows,
      variants=variants)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "kda_kernel_bundles.json"), "w") as fh:
    json.dump(report, fh, indent=1)


def _compile_variant(b, t, h, dtype, kw, sharding, mesh):
  """"compiled", or the error compiling the op's forward and backward on
  backend "pallas" for the v5e."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from linear_attention import ops
  from linear_attention.ops.kda import mosaic
  kw = dict(kw)
  segments = kw.pop("segments", False)
  d, f32 = 128, jnp.float32
  arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  args = [arg((b, t, h, d), dtype)] * 4 + [
      arg((b, t, h), dtype), arg((h,), f32), arg((h * d,), f32)]
  args += [arg((b, t), jnp.int32)] if segments else []

  def loss(q, k, v, g, beta, a_log, dt_bias, *segment_ids):
    out = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_gate_in_kernel=True, use_qk_l2norm=True, backend="pallas",
        segment_ids=segment_ids[0] if segment_ids else None, **kw)
    return sum(jnp.sum(x.astype(f32)) for x in jax.tree.leaves(out))

  try:
    with mosaic.lowering_mode("v5e", mesh=mesh):
      lowered = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).lower(*args)
    lowered.compile()
    return "compiled"
  except Exception as e:  # pylint: disable=broad-except
    return f"error: {e!r}"[:4000]


def _libtpu_version(path):
  """The version in the dist-info beside `path`'s package, if any."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  for entry in os.listdir(root):
    m = re.match(r"libtpu-([\d.]+)\.dist-info$", entry)
    if m:
      return m[1]
  return None


if __name__ == "__main__":
  cli.run_script(main)
