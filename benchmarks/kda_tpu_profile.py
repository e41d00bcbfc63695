r"""Where a KDA call's time goes on a TPU: a profile of each implementation.

    python -m benchmarks.kda_tpu_profile --out=DIR                 # on a TPU host
    python -m benchmarks.kda_tpu_profile --summarize=TRACE.json.gz  # any host

For each implementation (`--impls`) and pass (`--passes`: forward, and
forward+backward by `jax.grad` of a scalar of the output) at one shape, the
script compiles the call, runs it once untimed, then records `--calls` calls
under `jax.profiler.trace` into `DIR/<impl>_<pass>/`, each waited for
(`wall_ms_per_call`), and, outside the trace, times ten calls dispatched
back to back and waited for once (`pipelined_ms_per_call`: what a loop
that does not wait for each result sees). It reads the Chrome
trace the profiler writes there (`plugins/profile/*/*.trace.json.gz`) and
sums the device's exclusive time per op name over the recorded calls: Pallas kernels
(`tpu_custom_call`s) by their kernel name, XLA fusions, copies (relayouts)
and the rest by their HLO name. `DIR/kda_tpu_profile.json` gets, per
implementation and pass, the device time per call, the busy fraction of the
calls' wall time, and the ops that take it, largest first (written after
each profile, so an interrupted run keeps what it measured); a markdown
table is printed. `--summarize` applies the same reading to a trace file.

Implementations, all on the same raw inputs (`kda_tpu.inputs`: the fused
lower-bound gate at -5, q/k L2 norm, as the KDA layer calls the op):

* `chunked`: the op's XLA chunked backend at `precision="auto"`;
* `kernel`: our Pallas kernel (`pallas_tpu.kda_forward`, with its backward
  kernel under `jax.grad`) after the op's own preparation in XLA (gates,
  L2 norm, scale);
* `batched`: the batched-heads kernels (`pallas_batched.kda`) on the raw
  inputs: the forward kernel normalises, scales and gates each block
  itself; the backward prepares in XLA (8 heads a step; `batched_hb16`
  16; `batched_strided` reads the op's layout as rows, all heads a step);
* `batched_fused`, `batched_hb16_fused`, `batched_strided_fused`: the
  same with the fused backward (`fused_backward=True`, the kernels'
  default: the backward kernel prepares each raw block and pulls the
  gradients back through the preparation itself; 8 and 16 heads a step,
  and strided);
* `batched_strided_hb16bwd_fused`: the strided forward with the fused
  backward on unstrided blocks of 16 heads (`strided_backward=False`);
* `batched_hball_fused`, `batched_hb16_c128_fused`,
  `batched_hb8_c128_fused`: the grid step's shape: all H heads a step
  (unstrided), or 128-token chunks (`_c128`; 64 otherwise), with the fused
  backward;
* `tokamax_mosaic`: tokamax's Pallas kernel (its generation check lifted);
* `chunked_chunkstates`, `pallas_chunkstates`: the op on that backend with
  the final state and the state after every 1024 tokens
  (`output_chunk_states`); `..._chunkstates64`: after every 64 tokens.

`--precision` sets our implementations' matmul precision: a name of the
op ("auto", "highest", "high", "default") or four, comma-separated, one per
group (scores, solve, state, output; `ops/kda/precision.py`), e.g.
`highest,high,highest,high` (measured within the op's float32 bounds in
interpret mode; docs/kernel.md).

`--documents=N` packs every row with documents of N tokens (segment ids
1, 2, ...; the last one shorter), as training on packed text calls the op;
`chunked` and the `batched` kernels (not strided) take them, the others
record an error. With them, `chunked_states` and `batched*_states` also
carry per-segment states (zero initial states in, final states out).
"""

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import platform
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import kda_speed
from benchmarks import kda_tpu
from experiments.tools import cli
from linear_attention import ops
from linear_attention.ops import backends
from linear_attention.ops.kda import gates
from linear_attention.ops.kda import mosaic
from linear_attention.ops.kda import pallas_batched
from linear_attention.ops.kda import pallas_tpu
from linear_attention.ops.kda import precision as precision_lib

IMPLS = ("chunked", "kernel", "batched", "batched_hb16", "batched_strided",
         "batched_fused", "batched_hb16_fused", "batched_strided_fused",
         "batched_strided_hb16bwd_fused", "batched_hball_fused",
         "batched_hb16_c128_fused", "batched_hb8_c128_fused",
         "tokamax_mosaic", "chunked_chunkstates", "pallas_chunkstates",
         "chunked_chunkstates64", "pallas_chunkstates64")
PASSES = ("fwd", "fwd_bwd")


def _interpret():
  """Pallas interpret mode unless the function is traced for a TPU (the
  device here, or the one lowered for: `mosaic.lowering_mode`)."""
  return backends.target_platform() != "tpu"


def kernel_op(heads_per_block=None, forward=pallas_tpu.kda_forward):
  """f(q, k, v, g, beta, a_log, dt_bias) -> o through our Pallas kernel."""

  def f(q, k, v, g, beta, a_log, dt_bias):
    interpret = _interpret()
    d = q.shape[-1]
    dtype = q.dtype
    qn = gates.l2_normalize(q, dtype=jnp.float32) * d ** -0.5
    kn = gates.l2_normalize(k, dtype=jnp.float32)
    gl = gates.kda_log_decay(g, a_log, dt_bias, -5.0, dtype=jnp.float32)
    o, _ = forward(
        qn.astype(dtype), kn.astype(dtype), v, gl, beta.astype(jnp.float32),
        precision=precision_lib.resolve("auto", dtype),
        heads_per_block=heads_per_block, lower_bound=-5.0,
        interpret=interpret)
    return o
  return f


def parse_precision(text):
  """--precision: an op name, or four group names (scores, solve, state,
  output) -> what `precision_lib.resolve` takes."""
  names = text.split(",")
  if len(names) == 1:
    precision_lib.validate(text)
    return text
  levels = {"highest": jax.lax.Precision.HIGHEST,
            "high": jax.lax.Precision.HIGH,
            "default": jax.lax.Precision.DEFAULT}
  if len(names) != 4 or any(n not in levels for n in names):
    raise ValueError(f"--precision: a name of {precision_lib.NAMES} or four"
                     f" of {tuple(levels)} (scores, solve, state, output);"
                     f" got {text!r}")
  return precision_lib.Precisions(*(levels[n] for n in names))


def _num_segments(segment_ids, states):
  """N, the last of `documents`' ids, read once outside any trace (the
  kernels' bound is static); None without `states`."""
  return int(segment_ids[0, -1]) if states else None


def _segment_states(n, q, v):
  """Zero initial states [B, N, H, K, V], one per segment; None without
  N."""
  if n is None:
    return None
  b, t, h, kd = q.shape
  return jnp.zeros((b, n, h, kd, v.shape[-1]), jnp.float32)


def batched_op(heads_per_block=None, strided=False, fused_backward=False,
               segment_ids=None, precision="auto", states=False,
               strided_backward=None, chunk=pallas_tpu.DEFAULT_CHUNK):
  """Our batched-heads kernel on the raw inputs (preparation inside it);
  with `states`, per-segment initial and final states. heads_per_block:
  a number, "all" (H) or None (the kernel's default); `chunk` tokens a
  chunk; `strided_backward` as `pallas_batched.kda` takes it."""
  n = _num_segments(segment_ids, states)

  def f(q, k, v, g, beta, a_log, dt_bias):
    interpret = _interpret()
    s0 = _segment_states(n, q, v)
    hb = q.shape[2] if heads_per_block == "all" else heads_per_block
    o, final = pallas_batched.kda(
        q, k, v, g, beta, s0, scale=q.shape[-1] ** -0.5, a_log=a_log,
        dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True,
        use_qk_l2norm=True,
        precision=precision_lib.resolve(precision, q.dtype),
        heads_per_block=hb, strided=strided,
        strided_backward=strided_backward, fused_backward=fused_backward,
        segment_ids=segment_ids, num_segments=n, chunk=chunk,
        interpret=interpret)
    return (o, final) if states else o
  return f


def chunked_op(segment_ids=None, precision="auto", states=False):
  """The op's chunked backend (on packed rows with `segment_ids`; with
  `states`, per-segment initial and final states)."""
  n = _num_segments(segment_ids, states)

  def f(q, k, v, g, beta, a_log, dt_bias):
    s0 = _segment_states(n, q, v)
    o, final = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_gate_in_kernel=True, use_qk_l2norm=True, segment_ids=segment_ids,
        initial_state=s0, output_final_state=states, max_num_segments=n,
        backend="chunked", precision=precision)
    return (o, final) if states else o
  return f


CHUNK_STATES_EVERY = 1024


def chunk_states_op(backend, every=CHUNK_STATES_EVERY):
  """The op on `backend` with `output_chunk_states` (the state after every
  `every` tokens) and the final state, through the public op (the backend
  "pallas" writes them from its kernels' one pass,
  `pallas.one_pass_chunk_states`; "chunked" by exact state passing over
  pieces, `context_parallel.run`; off a TPU in Pallas interpret mode)."""
  on_tpu = jax.devices()[0].platform == "tpu"

  def f(q, k, v, g, beta, a_log, dt_bias):
    with (contextlib.nullcontext() if on_tpu or backend != "pallas"
          else mosaic.interpreted()):
      return ops.kimi_delta_attention(
          q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
          use_gate_in_kernel=True, use_qk_l2norm=True,
          output_final_state=True, output_chunk_states=True,
          chunk_states_every=min(every, q.shape[1]),
          backend=backend)
  return f


def documents(b, t, n):
  """[B, T] int32 segment ids: documents of n tokens, numbered from 1."""
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // n + 1, (b, t))


def implementation(name, segment_ids=None, precision="auto"):
  """The function `name` times (`IMPLS`; "chunked" and "batched*" with the
  suffix "_states" and packed rows: per-segment states as well)."""
  states = name.endswith("_states")
  if states:
    name = name[:-len("_states")]
    if segment_ids is None or not (name == "chunked"
                                   or name.startswith("batched")):
      raise ValueError(f"{name}_states: needs --documents and chunked or a"
                       " batched kernel")
  if segment_ids is not None and (name in ("kernel", "tokamax_mosaic")
                                  or name.startswith("batched_strided")):
    raise ValueError(f"--documents: {name} takes no packed segments here")
  if name != "chunked" and not name.startswith("batched") and (
      precision != "auto"):
    raise ValueError(f"--precision: {name} runs at its own precision here")
  every = re.search(r"_chunkstates(\d*)$", name)
  if every:
    if segment_ids is not None or precision != "auto":
      raise ValueError(f"{name}: no --documents, precision 'auto'")
    return chunk_states_op(name[:every.start()],
                           int(every[1] or CHUNK_STATES_EVERY))
  if name == "chunked":
    return chunked_op(segment_ids, precision, states)
  if name == "kernel":
    return kernel_op()
  if name.startswith("batched"):
    heads = re.search(r"_hb(\d+|all)", name)
    chunk = re.search(r"_c(\d+)", name)
    heads = heads and (heads[1] if heads[1] == "all" else int(heads[1]))
    return batched_op(heads_per_block=heads or None,
                      chunk=int(chunk[1]) if chunk else
                      pallas_tpu.DEFAULT_CHUNK,
                      strided=name.startswith("batched_strided"),
                      strided_backward=False if "hb16bwd" in name else None,
                      fused_backward=name.endswith("_fused"),
                      segment_ids=segment_ids, precision=precision,
                      states=states)
  if name == "tokamax_mosaic":
    return kda_tpu.tokamax_mosaic()
  raise ValueError(f"--impls: unknown implementation {name!r}; allowed: "
                   f"{', '.join(IMPLS)}")


def with_pass(f, pass_name):
  if pass_name == "fwd":
    return f
  if pass_name == "fwd_bwd":
    loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) ** 2)
                          for x in jax.tree.leaves(f(*a)))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    return grads
  raise ValueError(f"--passes: unknown pass {pass_name!r}; allowed: "
                   f"{', '.join(PASSES)}")


def _events(trace):
  """(process names, thread names, complete events) of a Chrome trace."""
  procs, threads, spans = {}, {}, []
  for e in trace.get("traceEvents", []):
    ph = e.get("ph")
    if ph == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e.get("args", {}).get("name", "")
    elif ph == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    elif ph == "X":
      spans.append(e)
  return procs, threads, spans


def _exclusive(spans):
  """[(span, exclusive us, depth)]: ops nested in another (a loop's body in
  its `while`) are subtracted from their parent and counted once."""
  out, stack = [], []
  for e in sorted(spans, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
    start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
    while stack and start >= stack[-1][1] - 1e-6:
      stack.pop()
    rec = [e, float(e["dur"]), len(stack)]
    if stack:
      stack[-1][2][1] -= float(e["dur"])
    out.append(rec)
    stack.append((start, end, rec))
  return out


def summarize(path, calls=1):
  """Device time per op of one trace file, in microseconds per call.

  Device planes are the processes whose name holds "TPU" (or "GPU"); on
  those, the "XLA Ops" line holds one span per executed op (a Pallas kernel
  is one custom-call op; a loop's body ops lie inside its `while` span, so
  each op is counted by its exclusive time), "XLA Modules" one per program.
  `ops_busy_us_per_call` sums the ops' exclusive times; `ops_span_us_per_call`
  runs from the first op of the first call to the last op of the last, so
  it holds the host's round trips between the calls too (a gap inside a
  program shows as its module's time, `modules_us_per_call`, above the
  busy time).
  """
  with gzip.open(path, "rt") as fh:
    trace = json.load(fh)
  procs, threads, spans = _events(trace)
  device = {p for p, n in procs.items()
            if ("TPU" in n or "GPU" in n) and "host" not in n.lower()}
  per_line = collections.defaultdict(float)
  ops = collections.defaultdict(lambda: [0.0, 0])
  categories = collections.defaultdict(float)
  modules = collections.defaultdict(float)
  op_spans = []
  for e in spans:
    if e["pid"] not in device:
      continue
    line = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
    per_line[line] += float(e.get("dur", 0.0))
    if line == "XLA Ops":
      op_spans.append(e)
    elif line == "XLA Modules":
      modules[e.get("name", "?")] += float(e.get("dur", 0.0))
  first = min((float(e["ts"]) for e in op_spans), default=0.0)
  last = max((float(e["ts"]) + float(e["dur"]) for e in op_spans),
             default=0.0)
  busy = 0.0
  for e, excl, _ in _exclusive(op_spans):
    name = e.get("name", "?")
    ops[name][0] += excl
    ops[name][1] += 1
    categories[e.get("args", {}).get("hlo_category", "?")] += excl
    busy += excl
  rows = sorted(((n, t / calls, c // max(calls, 1)) for n, (t, c) in
                 ops.items()), key=lambda r: -r[1])
  return dict(
      device_planes=sorted(procs[p] for p in device),
      lines_us=dict(sorted(per_line.items())),
      modules_us_per_call={k: v / calls for k, v in modules.items()},
      ops_busy_us_per_call=busy / calls,
      ops_span_us_per_call=(last - first) / calls,
      categories_us_per_call={k: round(v / calls, 2) for k, v in
                              sorted(categories.items(), key=lambda kv: -kv[1])},
      ops=[dict(name=n, us_per_call=round(t, 2), count_per_call=c)
           for n, t, c in rows])


def _trace_file(logdir):
  found = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                        "*.trace.json.gz")))
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {logdir}/plugins/profile")
  return found[-1]


def profile_one(fn, args, logdir, calls):
  f = jax.jit(fn)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(f(*args))
  walls = []
  with jax.profiler.trace(logdir):
    for _ in range(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      walls.append(time.perf_counter() - t0)
  s = summarize(_trace_file(logdir), calls)
  s["compile_and_first_call_s"] = round(compile_s, 3)
  s["wall_ms_per_call"] = [round(w * 1e3, 3) for w in walls]
  s["pipelined_ms_per_call"] = round(pipelined(f, args) * 1e3, 3)
  return s


PIPELINED_CALLS = 10


def pipelined(f, args, calls=PIPELINED_CALLS):
  """Seconds per call of `calls` calls dispatched back to back and synced
  once (outside the trace), as a training loop issues them: the host's
  dispatch overlaps the device's work, where each call of
  `wall_ms_per_call` waits for its result (a fixed host round trip on top
  of the device time)."""
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def markdown(results, top):
  out = []
  for key, s in results.items():
    if "error" in s:
      out.append(f"### {key}: error\n\n{s['error'][:300]}\n")
      continue
    wall = statistics.median(s["wall_ms_per_call"])
    piped = (f", pipelined {s['pipelined_ms_per_call']:.3f} ms"
             if "pipelined_ms_per_call" in s else "")
    out.append(f"### {key}: device busy {s['ops_busy_us_per_call'] / 1e3:.3f}"
               f" ms/call, op span {s['ops_span_us_per_call'] / 1e3:.3f} ms,"
               f" wall {wall:.3f} ms{piped}\n")
    out.append("| op | us/call | count/call | share |\n|---|---:|---:|---:|")
    busy = s["ops_busy_us_per_call"] or 1.0
    for r in s["ops"][:top]:
      out.append(f"| `{r['name'][:60]}` | {r['us_per_call']:.1f} |"
                 f" {r['count_per_call']} | {100 * r['us_per_call'] / busy:.1f}% |")
    out.append("")
  return "\n".join(out)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="kda_tpu_profile", type=cli.output_folder)
  p.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (K = V)",
                 type=cli.positive_ints)
  p.add_argument("--dtype", default="bfloat16",
                 choices=("bfloat16", "float32"))
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--passes", default=",".join(PASSES))
  p.add_argument("--calls", type=cli.positive_int, default=3,
                 help="calls recorded (with --summarize: in the trace read)")
  p.add_argument("--top", type=cli.positive_int, default=15)
  p.add_argument("--precision", default="auto",
                 help="an op precision name, or four group names")
  p.add_argument("--documents", type=int, default=0,
                 help="pack rows with documents of this many tokens (0: none)")
  p.add_argument("--summarize", default=None,
                 help="a *.trace.json.gz to read instead of profiling")
  a = p.parse_args()
  if a.summarize:
    s = summarize(a.summarize, a.calls)
    print(json.dumps({k: v for k, v in s.items() if k != "ops"}, indent=1))
    print(markdown({a.summarize: dict(s, wall_ms_per_call=[0.0])}, a.top))
    return
  shape = tuple(a.shape)
  if len(shape) != 4:
    p.error(f"--shape: four integers B,T,H,K; got {a.shape}")
  for flag, given, known in (("--impls", a.impls, IMPLS),
                             ("--passes", a.passes, PASSES)):
    unknown = [n for n in given.split(",") if n not in known]
    if unknown:
      p.error(f"{flag}: unknown {unknown}; allowed: {', '.join(known)}")
  try:
    precision = parse_precision(a.precision)
  except ValueError as e:
    p.error(str(e))
  if a.documents < 0:
    p.error(f"--documents: 0 (none) or a document length; got {a.documents}")
  os.makedirs(a.out, exist_ok=True)
  args = kda_tpu.inputs(*shape, dtype=a.dtype)
  ids = documents(shape[0], shape[1], a.documents) if a.documents else None
  results = {}
  meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
              host=platform.node(), shape=shape, dtype=a.dtype,
              calls=a.calls, documents=a.documents, precision=a.precision)
  for impl in a.impls.split(","):
    for pass_name in a.passes.split(","):
      key = f"{impl}_{pass_name}"
      try:
        results[key] = profile_one(
            with_pass(implementation(impl, ids, precision), pass_name), args,
            os.path.join(a.out, key), a.calls)
      except Exception as e:  # pylint: disable=broad-except
        results[key] = dict(error=repr(e)[:2000] + traceback.format_exc()[-3000:])
      with open(os.path.join(a.out, "kda_tpu_profile.json"), "w") as fh:
        json.dump(dict(meta=meta, results=results), fh, indent=1)
  print(markdown(results, a.top))


if __name__ == "__main__":
  cli.run_script(main)
