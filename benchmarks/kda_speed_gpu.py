r"""KDA speed on a GPU: our `chunked` against flash-linear-attention's Triton.

    python -m benchmarks.kda_speed_gpu [--out=benchmarks/results/kda_speed_gpu.json]

Needs a CUDA GPU, jax with its CUDA plugin, PyTorch and flash-linear-attention
(`fla-core`; its `fla.ops.kda.chunk_kda`, the Triton kernels the paper's
authors train with). One process holds both frameworks; unless set, it
sets XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_ALLOCATOR=
platform so that they share the GPU's memory.

For each shape (B, T, H, K=V, dtype, packed documents) it times, on the same
inputs, the forward and the forward+backward (gradients of every input,
through the cotangent of `sum(o * cos(o))`) of:

* `ours`: our `chunked` backend with the platform's defaults (64-token
  chunks on a GPU);
* `ours_c16`, `ours_gw4`: the same with 16-token chunks, and with 4x the
  grouped scan's default group width (`--variants` picks the shapes), the
  two tuning knobs whose GPU values were not measured before; and for
  float32, `ours_highest`: full float32 products (jax's default precision
  runs them at TF32 on a GPU);
* `fla`: fla's `chunk_kda` with the same gate (the fused lower-bound gate,
  `safe_gate=True, lower_bound=-5`, A_log and dt_bias), q/k L2 norm in the
  kernel, `cu_seqlens` for packed documents.

Timing is `kda_speed.time_rounds`: compile (and fla's Triton autotuning) first,
then rounds that call every implementation once in a rotating order; a torch
call ends with `torch.cuda.synchronize()`, a jax one with
`block_until_ready`. Reported: median milliseconds, fla's time over ours
paired per round (> 1: ours is faster), and GFLOP/s by the Kimi Linear FLOP
count (`kda_speed.kda_flops`).

Every output (and, for forward+backward, every gradient) is checked against
our `reference` backend (the token recurrence, float32 at
`jax.default_matmul_precision("highest")` through the backward pass too,
itself tested against a float64 oracle): relative L2 error, so a fast wrong
path cannot hide. The reference runs only where its compiled plan fits
(`--reference_grad_gib`: its gradients at (1, 8192, 32, 128) asked for
73 GiB); elsewhere the anchor is `ours_highest` (or `ours`), named in the
table.
"""

import argparse
import json
import os
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_error_vs_length
from benchmarks import kda_speed
from experiments.tools import cli
from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda.chunked import grouped

LOWER_BOUND = -5.0
# (B, T, H, K=V), dtype, packed documents (None: one per row).
SHAPES = {
    "1x4096x4x64": ((1, 4096, 4, 64), "float32", None),
    "2x2048x8x128": ((2, 2048, 8, 128), "float32", None),
    **kda_speed.NAMED_SHAPES,
}


def ours(segments=None, backend="chunked", chunk_size=None, group_width=None):
  def f(q, k, v, g, beta, a_log, dt_bias, ids=None):
    o, _ = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        lower_bound=LOWER_BOUND, use_gate_in_kernel=True, use_qk_l2norm=True,
        backend=backend, chunk_size=chunk_size, group_width=group_width,
        segment_ids=ids, max_num_segments=segments)
    return o
  return f


def compiled(f, mode, precision=None):
  """jit of the forward or the forward+backward of `f`, traced at jax's
  matmul `precision` (None: the default, TF32 float32 products on a GPU).

  The context wraps the gradient too: a context inside `f` alone would
  leave the backward pass (transposed after `f` returns) at the default.
  """
  g = f if mode == "forward" else kda_speed.fwd_bwd(f)

  def run(*args):
    with jax.default_matmul_precision(precision):
      return g(*args)
  return jax.jit(run)


def fla_call(segments):
  """(q, k, v, g, beta, a_log, dt_bias, cu_seqlens) torch tensors -> o."""
  from fla.ops.kda import chunk_kda  # pylint: disable=g-import-not-at-top

  def f(q, k, v, g, beta, a_log, dt_bias, cu_seqlens=None):
    o, _ = chunk_kda(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias,
                     use_gate_in_kernel=True, safe_gate=True,
                     lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True,
                     cu_seqlens=cu_seqlens if segments else None)
    return o
  return f


def torch_inputs(jax_args, dtype, ids):
  """Our jax inputs as CUDA torch tensors (the same values, bf16 rounded the
  same way), plus cu_seqlens from the segment ids."""
  import torch  # pylint: disable=g-import-not-at-top
  out = []
  for i, x in enumerate(jax_args):
    t = torch.from_numpy(np.array(x, np.float32)).cuda()
    if dtype == "bfloat16" and i < 5:  # a_log, dt_bias stay float32
      t = t.to(torch.bfloat16)
    out.append(t.requires_grad_(True))
  cu = None
  if ids is not None:  # fla packs documents into one row: B = 1
    if ids.shape[0] != 1:
      raise ValueError(f"packed shapes need B = 1; got B = {ids.shape[0]}.")
    lengths = np.bincount(np.asarray(ids)[0])[1:]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]),
                      dtype=torch.long, device="cuda")
  return out, cu


def torch_timed(fn, mode, tensors, cu):
  """A call that runs fla (forward, or forward and its gradients) to the end
  on the GPU; returns the outputs as numpy float32 arrays."""
  import torch  # pylint: disable=g-import-not-at-top

  def call():
    if mode == "forward":
      with torch.no_grad():
        out = (fn(*tensors, cu),)
    else:
      o = fn(*tensors, cu)
      out = torch.autograd.grad((o * torch.cos(o)).sum(), tensors,
                                allow_unused=True)
    torch.cuda.synchronize()
    return out

  def as_numpy(out):  # a gradient fla does not return reads as NaN
    return [np.full(tuple(t.shape), np.nan, np.float32) if x is None
            else x.detach().float().cpu().numpy()
            for x, t in zip(out, tensors)]

  return call, as_numpy


def flat(xs):
  return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in xs])


def errors(outs, anchor):
  """Relative L2 error of each output list against `anchor`'s, over all
  outputs together and per output."""
  return {n: dict(all=testing.relative_l2_error(flat(o), flat(anchor)),
                  each=[testing.relative_l2_error(np.ravel(a), np.ravel(b))
                        for a, b in zip(o, anchor)])
          for n, o in outs.items()}


def bench_shape(name, repeats, variants, reference_grad_gib):
  import torch  # pylint: disable=g-import-not-at-top
  (b, t, h, d), dtype, segments = SHAPES[name]
  args = kda_speed.make_inputs(b, t, h, d, dtype=dtype)
  ids = kda_speed.segment_ids(b, t, segments) if segments else None
  jargs = (*args, ids) if segments else args
  impls = {"ours": (ours(segments), None)}
  if variants:
    impls["ours_c16"] = (ours(segments, chunk_size=16), None)
    impls["ours_gw4"] = (
        ours(segments, group_width=4 * grouped.GROUP_WIDTH), None)
    if dtype == "float32":
      impls["ours_highest"] = (ours(segments), "highest")
  fla = fla_call(segments)
  tensors, cu = torch_inputs(args, dtype, ids)
  # The anchor: the token recurrence at full float32 matmul precision.
  ref_args = tuple(x.astype(jnp.float32) if i < 5 else x
                   for i, x in enumerate(args)) + ((ids,) if segments else ())
  rows = []
  for mode in ("forward", "forward+backward"):
    fns = {n: compiled(f, mode, p) for n, (f, p) in impls.items()}
    outs = {n: [np.asarray(x, np.float32) for x in
                jax.tree.leaves(jax.block_until_ready(fn(*jargs)))]
            for n, fn in fns.items()}
    call, as_numpy = torch_timed(fla, mode, tensors, cu)
    outs["fla"] = as_numpy(call())  # compiles and autotunes the kernels
    anchor_name = "reference"
    ref = compiled(ours(segments, backend="reference"), mode, "highest")
    ref = ref.lower(*ref_args).compile()  # its plan first, then the run
    plan = ref.memory_analysis()
    ref_bytes = None if plan is None else plan.temp_size_in_bytes
    if ref_bytes is not None and ref_bytes <= reference_grad_gib * 2**30:
      anchor = [np.asarray(x, np.float32)
                for x in jax.tree.leaves(ref(*ref_args))]
    else:
      anchor_name = "ours_highest" if "ours_highest" in outs else "ours"
      anchor = outs[anchor_name]
    del ref
    errs = errors(outs, anchor)
    calls = {n: (fn, jargs) for n, fn in fns.items()}
    calls["fla"] = (lambda: (call(), None)[1], ())
    # One untimed round: the first call after compiling ran up to 3.5x slow.
    kda_speed.time_rounds({}, (), 1, extra=calls)
    times = kda_speed.time_rounds({}, (), repeats, extra=calls)
    flops = kda_speed.kda_flops(b, t, h, d) * (1 if mode == "forward" else 3)
    for n, ts in times.items():
      rows.append(dict(
          shape=(b, t, h, d), name=name, dtype=dtype, segments=segments,
          mode=mode, impl=n, ms=statistics.median(ts) * 1e3,
          ms_rounds=[x * 1e3 for x in ts],
          fla_over_this=kda_speed.paired(times["fla"], ts),
          gflops=flops / statistics.median(ts) / 1e9,
          error_anchor=anchor_name, rel_err=errs[n]["all"],
          rel_err_each=errs[n]["each"]))
    del fns, outs
    torch.cuda.empty_cache()
  return rows


def matmul_rates():
  """TFLOP/s of an 8192^3 product: jax f32 (its default precision), jax
  bf16, torch bf16; the best of 5 calls each."""
  import time  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  n = 8192
  rates = {}
  for dtype in ("float32", "bfloat16"):
    a = jax.random.normal(jax.random.key(0), (n, n)).astype(dtype)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = min(kda_speed.time_rounds({"mm": f}, (a,), 5)["mm"])
    rates[f"jax_{dtype}"] = 2 * n ** 3 / best / 1e12
  x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
  x @ x
  torch.cuda.synchronize()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    x @ x
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - start)
  rates["torch_bfloat16"] = 2 * n ** 3 / best / 1e12
  return rates


def markdown(rows):
  lines = ["| shape | dtype | docs | pass | impl | ms | fla / this | GFLOP/s"
           " | rel. error (vs) |", "|---|---|---:|---|---|---:|---:|---:|---|"]
  for r in rows:
    lines.append(
        f"| {r['name']} | {r['dtype']} | {r['segments'] or 1} | {r['mode']} |"
        f" {r['impl']} | {r['ms']:.2f} | {r['fla_over_this']:.2f} |"
        f" {r['gflops']:.0f} | {r['rel_err']:.1e} ({r['error_anchor']}) |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=cli.positive_int, default=10)
  parser.add_argument("--shapes", default=",".join(SHAPES),
                      help=f"comma-separated, of: {', '.join(SHAPES)}")
  parser.add_argument("--variants", default="1x4096x4x64,"
                      "fixed_training_b1_t8192_bf16",
                      help="shapes that also time ours_c16 and ours_gw4")
  parser.add_argument("--reference_grad_gib", type=float, default=32.0,
                      help="the reference anchor runs only where XLA plans"
                      " at most this many GiB of temporaries for it")
  parser.add_argument("--train_step", default="mqar",
                      help="config whose training step is timed per KDA"
                      " backend ('mqar', 'delayed_copy' or 'none')")
  parser.add_argument("--out", default="benchmarks/results/kda_speed_gpu.json",
                      type=cli.output_path)
  a = parser.parse_args()
  # Before jax starts its GPU client: jax takes its memory as it needs it
  # (not 75% up front) and hands freed blocks back, so that torch's kernels
  # and the anchor's temporaries fit beside it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  import fla  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu" or not torch.cuda.is_available():
    parser.error("needs a CUDA GPU visible to both jax and torch")
  machine = dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                 device=jax.devices()[0].device_kind, jax=jax.__version__,
                 torch=torch.__version__,
                 fla=getattr(fla, "__version__", None))
  machine["commit"], machine["dirty"] = kda_error_vs_length.git_commit()
  result = dict(machine=machine, matmul_tflops=matmul_rates(), rows=[],
                train_step=[])
  print(json.dumps(result, indent=1), flush=True)
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

  def save():  # after every piece, so an interrupted run keeps the rest
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)

  variants = set(a.variants.split(",")) if a.variants else set()
  for name in a.shapes.split(","):
    result["rows"] += bench_shape(name, a.repeats, name in variants,
                                  a.reference_grad_gib)
    print(markdown(result["rows"]), flush=True)
    save()
  if a.train_step != "none":
    result["train_step"] = kda_speed.bench_train_step(a.repeats, a.train_step)
    print(kda_speed.markdown_train(result["train_step"]), flush=True)
    save()


if __name__ == "__main__":
  cli.run_script(main)
