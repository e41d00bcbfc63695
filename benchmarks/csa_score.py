"""CSA indexer score: memory and time of `reference` vs `xla_chunked`, and a
TPU roofline estimate for the fused Pallas kernels.

    .venv/bin/python -m benchmarks.csa_score          # S=4096 W=1024 H=16 D=64
    .venv/bin/python -m benchmarks.csa_score --small  # a quick smoke run
    .venv/bin/python -m benchmarks.csa_score --out=benchmarks/results/csa_score_cpu.json

Peak memory is XLA's compiled temp allocation
(`jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`):
deterministic, unlike wall-clock. Times are medians over rounds that call
both implementations in turn (`kda_speed.time_rounds`), the ratio the median
of the per-round ratios, on whatever device JAX picks (CPU here). The
Pallas numbers are the kernels' `cost_estimate` (FLOPs, HBM bytes) against
TPU v6e peak bf16 FLOP/s and HBM bandwidth from
`pltpu.get_tpu_info_for_chip`: an estimate, not a measurement.
Prints markdown tables; `--out=PATH` also writes the numbers as JSON, with
the commit and the machine's float32 matmul rate.
"""

import argparse
import json
import os
import platform
import statistics

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_error_vs_length
from benchmarks import kda_speed
from experiments.tools import cli
from linear_attention import ops
from linear_attention.ops.csa import pallas


def inputs(b, s, w, h, d, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, s, h, d), dtype)
  k = jax.random.normal(ks[1], (b, w, d), dtype)
  wt = jax.random.normal(ks[2], (b, s, h), dtype)
  g = jax.random.normal(ks[3], (b, s, w), jnp.float32)
  return q, k, wt, g


def fns(backend, r):
  score = lambda q, k, w: ops.csa_streamindex_score(
      q, k, w, softmax_scale=q.shape[-1] ** -0.5, compress_rate=r,
      backend=backend)
  fwd = lambda q, k, w, g: score(q, k, w)

  def fwd_bwd(q, k, w, g):
    out, vjp = jax.vjp(score, q, k, w)
    return out, vjp(g)

  return {"forward": fwd, "forward+backward": fwd_bwd}


def main(small, out=None):
  b, s, w, h, d, r = (1, 512, 128, 4, 32, 4) if small else \
      (1, 4096, 1024, 16, 64, 4)
  reps = 7
  commit, dirty = kda_error_vs_length.git_commit()
  result = dict(commit=commit, dirty=dirty,
                machine=dict(platform=platform.platform(),
                             cpu_count=os.cpu_count(),
                             device=str(jax.devices()[0]), jax=jax.__version__),
                matmul_gflops=kda_speed.matmul_gflops(),
                shape=dict(b=b, s=s, w=w, h=h, d=d, r=r), dtype="float32",
                paired_rounds=reps, xla=[], pallas_tpu_v6e_estimate=[])
  args = inputs(b, s, w, h, d)
  print(f"B={b} S={s} W={w} H={h} D={d} r={r}, float32, device:"
        f" {jax.devices()[0].device_kind}, {reps} paired rounds (median)\n")
  print("| pass | reference temp | xla_chunked temp | memory ratio |"
        " reference time | xla_chunked time | time ratio |")
  print("|---|---|---|---|---|---|---|")
  ref_fns, chunk_fns = fns("reference", r), fns("xla_chunked", r)
  for name in ref_fns:
    jitted = {"reference": jax.jit(ref_fns[name]),
              "xla_chunked": jax.jit(chunk_fns[name])}
    m0 = kda_speed.temp_bytes(jitted["reference"], args)
    m1 = kda_speed.temp_bytes(jitted["xla_chunked"], args)
    for f in jitted.values():
      jax.block_until_ready(f(*args))  # compile and warm up
    times = kda_speed.time_rounds(jitted, args, reps)
    t0 = statistics.median(times["reference"])
    t1 = statistics.median(times["xla_chunked"])
    ratio = kda_speed.paired(times["xla_chunked"], times["reference"])
    print(f"| {name} | {m0 / 2**20:.1f} MiB | {m1 / 2**20:.1f} MiB |"
          f" {m0 / m1:.1f}x less | {t0 * 1e3:.0f} ms | {t1 * 1e3:.0f} ms |"
          f" {ratio:.2f}x |")
    result["xla"].append(dict(
        **{"pass": name}, reference_temp_bytes=m0, xla_chunked_temp_bytes=m1,
        reference_seconds=times["reference"],
        xla_chunked_seconds=times["xla_chunked"], time_ratio=ratio))

  # Pallas kernels on TPU v6e: roofline from the kernels' own cost estimate.
  info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V6E, 1)
  bq, bw, hc = pallas.resolve_tiles(s, w, h)
  tiles = pallas.Tiles(d ** -0.5, bq, bw, hc, interpret=False)
  nq, nk = -(-s // bq), -(-w // bw)
  qmax = (np.arange(nq) + 1) * bq - 1
  kmin = (np.arange(nk) * bw + 1) * r - 1
  live = float(np.mean(kmin[None, :] <= qmax[:, None]))
  print(f"\nPallas kernels, bf16 operands, tiles block_q={bq} block_w={bw}"
        f" head_chunk={hc}; TPU v6e: {info.bf16_ops_per_second / 1e12:.0f}"
        f" TFLOP/s bf16, {info.mem_bw_bytes_per_second / 1e12:.2f} TB/s HBM;"
        f" causal tiles live: {live:.0%}\n")
  print("| pass | GFLOP | HBM MB | FLOP/byte | roofline (dense) |"
        " roofline (live tiles only) | bound |")
  print("|---|---|---|---|---|---|---|")
  ridge = info.bf16_ops_per_second / info.mem_bw_bytes_per_second
  for name, bwd in (("forward", False), ("backward", True)):
    c = pallas.cost_estimate(b, s, w, h, d, jnp.bfloat16, tiles,
                             backward=bwd)
    t = max(c.flops / info.bf16_ops_per_second,
            c.bytes_accessed / info.mem_bw_bytes_per_second)
    ai = c.flops / c.bytes_accessed
    print(f"| {name} | {c.flops / 1e9:.1f} | {c.bytes_accessed / 1e6:.1f} |"
          f" {ai:.0f} | {t * 1e6:.0f} us | {t * live * 1e6:.0f} us |"
          f" {'compute' if ai > ridge else 'memory'} (ridge {ridge:.0f}) |")
    result["pallas_tpu_v6e_estimate"].append(dict(
        **{"pass": name}, flops=float(c.flops),
        hbm_bytes=float(c.bytes_accessed), roofline_seconds=t,
        live_tile_fraction=live))
  if out:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="a quick smoke run")
  parser.add_argument("--out", default=None, help="also write JSON here",
                      type=cli.output_path)
  cli.run_script(lambda: main(**vars(parser.parse_args())))
