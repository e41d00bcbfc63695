r"""Decoding one token after a context of L tokens: KDA's state against a KV cache.

    .venv/bin/python -m benchmarks.decode [--lengths=1024,...,32768] \
        [--rounds=5] [--steps=20] [--out=benchmarks/results/decode_cpu.json]

For each context length L it times one jitted decode step (one token, batch
1) of a KDA layer (`KimiDeltaAttention` with its `KDACache`: the recurrent
state and conv tails, the same size at every L) and of the attention layer
(`linear_attention.modules.attention`) with its KV cache holding L
positions, and measures each cache's bytes. Both layers have the text model's width and
heads (D 128, 2 heads of 64). Within a round the two are timed back to back
and the ratio is taken per round (paired), so the machine's slow spells hit
both alike; the table reports medians. Report the machine (its 2048^3 f32
matmul rate is printed) beside the numbers.
"""

import argparse
import json
import os
import platform
import statistics
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_speed
from experiments.tools import cli
from linear_attention.modules import attention as attention_lib
from linear_attention.modules import kda as kda_module

D, HEADS, HEAD_DIM, CONV = 128, 2, 64, 4


def _layers():
  """(name, transformed layer, init_cache(max_len)) of the two layers."""
  def kda_fwd(x, cache):
    return kda_module.KimiDeltaAttention(
        num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV,
        backend="chunked", name="kda")(x, cache=cache)

  def att_fwd(x, cache):
    return attention_lib.ShortConvSoftmaxAttention(
        num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV, rope=False,
        name="attention")(x, cache=cache)

  kda_cache = lambda length: kda_module.init_kda_cache(
      1, num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV)
  att_cache = lambda length: attention_lib.init_attention_cache(
      1, num_heads=HEADS, head_dim=HEAD_DIM, conv_size=CONV,
      max_len=length + 1)._replace(length=jnp.asarray(length, jnp.int32))
  return (("kda", hk.without_apply_rng(hk.transform(kda_fwd)), kda_cache),
          ("attention", hk.without_apply_rng(hk.transform(att_fwd)),
           att_cache))


def _filled(cache, seed):
  """The cache with random contents (the cost of a step does not depend on
  them; a real prefill of 32K tokens would only take longer)."""
  leaves, tree = jax.tree.flatten(cache)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [
      x if x.dtype == jnp.int32 else jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def bench(lengths, rounds, steps):
  x = jax.random.normal(jax.random.key(0), (1, 1, D))
  rows = []
  for length in lengths:
    fns, sizes = {}, {}
    for name, layer, make_cache in _layers():
      cache = _filled(make_cache(length), length)
      params = layer.init(jax.random.key(1), x, cache)
      step = jax.jit(layer.apply)
      jax.block_until_ready(step(params, x, cache))  # compile
      fns[name] = (step, params, cache)
      sizes[name] = sum(a.nbytes for a in jax.tree.leaves(cache))
    times = {name: [] for name in fns}
    for _ in range(rounds):
      for name, (step, params, cache) in fns.items():
        t0 = time.perf_counter()
        for _ in range(steps):
          out = step(params, x, cache)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - t0) / steps * 1e6)
    row = dict(context=length,
               kda_us=statistics.median(times["kda"]),
               attention_us=statistics.median(times["attention"]),
               attention_over_kda=kda_speed.paired(times["attention"],
                                                   times["kda"]),
               kda_cache_bytes=sizes["kda"],
               attention_cache_bytes=sizes["attention"])
    print(json.dumps(row))
    rows.append(row)
  return rows


def plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ctx = [r["context"] for r in rows]
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  a.plot(ctx, [r["kda_us"] for r in rows], "o-", label="KDA (state)")
  a.plot(ctx, [r["attention_us"] for r in rows], "s-",
         label="attention (KV cache)")
  a.set(xscale="log", yscale="log", xlabel="context length (tokens)",
        ylabel="decode step (us / token)", title="Per-token decode latency")
  b.plot(ctx, [r["kda_cache_bytes"] / 2**20 for r in rows], "o-",
         label="KDA (state)")
  b.plot(ctx, [r["attention_cache_bytes"] / 2**20 for r in rows], "s-",
         label="attention (KV cache)")
  b.set(xscale="log", yscale="log", xlabel="context length (tokens)",
        ylabel="cache (MiB, batch 1, one layer)", title="Decode cache size")
  for ax in (a, b):
    ax.set_xticks(ctx, [f"{c // 1024}K" for c in ctx])
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768",
                      type=cli.positive_ints)
  parser.add_argument("--rounds", type=cli.positive_int, default=5)
  parser.add_argument("--steps", type=cli.positive_int, default=20)
  parser.add_argument("--out", default="benchmarks/results/decode_cpu.json",
                      type=cli.output_path)
  args = parser.parse_args()
  rate = kda_speed.matmul_gflops()
  print(f"machine: {platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores, 2048^3 f32 matmul {rate:.0f} GFLOP/s")
  rows = bench(args.lengths, args.rounds, args.steps)
  with open(args.out, "w") as f:
    json.dump(dict(machine=dict(cpus=os.cpu_count(), matmul_gflops=rate,
                                backend=jax.default_backend()),
                   layer=dict(d_model=D, heads=HEADS, head_dim=HEAD_DIM,
                              conv_size=CONV, batch=1),
                   rows=rows), f, indent=2)
  plot(rows, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  cli.run_script(main)
