r"""KDA on a TPU: accuracy per matmul precision, and speed against tokamax.

    python -m benchmarks.kda_tpu --phase=accuracy --out=DIR
    python -m benchmarks.kda_tpu --phase=precision --out=DIR
    python -m benchmarks.kda_tpu --phase=table --out=DIR
    python -m benchmarks.kda_tpu --phase=mosaic --out=DIR
    python -m benchmarks.kda_tpu --phase=kernel --out=DIR

Each phase writes `DIR/kda_tpu_<phase>.json` after every piece (an
interrupted run keeps what it measured) and prints a markdown table.

* `accuracy`: float32 inputs with realistic gates (the fused lower-bound
  gate at -5 with a_log = log U(1, 16); at T = 1024 also the softplus gate),
  q/k L2 norm, against the same op in float64 on the host's CPU (the
  `reference` token scan, itself tested against a NumPy float64 recurrence
  and float64 finite differences): relative L2 error of the output, the
  final state and the gradient of every input under random cotangents, for
  each precision setting (`SETTINGS`). Bounds the TPU-first-class issue set:
  output and state 1e-5, gradients 1e-4 (g and beta 5e-4).
* `precision`: at B1 T8192 H32 K128 bfloat16, forward and forward+backward
  time of our default schedule, of the largest scan groups
  (`group_width=65536`: 16 chunks a step), and of tokamax's own Pallas
  kernel (`mosaic`) with its generation check lifted
  (`tokamax.config.cross_compile`), checked against our output: does it run
  on this chip? (The float32 times of each precision setting are `table`'s.)
* `mosaic`: tokamax's Pallas kernel and its `xla_chunked` on `accuracy`'s
  T = 1024 case, against the same float64 oracle.
* `kernel`: our Pallas TPU forward (`ops/kda/pallas_tpu.py`) on the chip,
  on prepared inputs (q, k L2-normalised, q scaled, g from the lower-bound
  gate at -5): its output and final state against the float64 oracle at
  B1 T1024 H4 K128 beside `chunked` on the same inputs, then at B1 T8192
  H32 K128 float32 its time per heads-per-block setting and precision
  against `chunked` at the same precision (both with the final state),
  forward and forward+backward (the backward kernel).
* `table`: B1 T8192 H32 K128 and B8 T4096 H16 K128 (or `--shapes`),
  bfloat16 and float32 (or `--dtypes`),
  ours at "default" and at "highest" precision and tokamax `xla_chunked`,
  and on a TPU also our Pallas kernels (backend `pallas`, precision "auto")
  and tokamax's (`mosaic`, its generation check lifted),
  forward and forward+backward, in ms and as a fraction of the chip's
  measured bfloat16 matmul rate (8192^3, this process) by the Kimi Linear
  FLOP count (`kda_speed.kda_flops`; forward+backward counted 3x).

Timing: compile, one untimed call, then `--repeats` rounds calling every
implementation of a group once in rotating order (`kda_speed.time_rounds`,
one warm call before each timed call); ratios are medians of per-round
ratios. `--smoke` shrinks every shape (for the CPU test of this script).
"""

import argparse
import json
import os
import platform
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_error_vs_length
from benchmarks import kda_speed
from experiments.tools import cli
from linear_attention import ops
from linear_attention import testing
from linear_attention.ops.kda import gates
from linear_attention.ops.kda import pallas_tpu
from linear_attention.ops.kda import precision as precision_lib

P = jax.lax.Precision
Precisions = precision_lib.Precisions
# Precision settings compared: the op's names and per-group mixes.
SETTINGS = {
    "default": "default",
    "high": "high",
    "highest": "highest",
    "high_solve_highest": Precisions(P.HIGH, P.HIGHEST, P.HIGH, P.HIGH),
    "high_state_highest": Precisions(P.HIGH, P.HIGH, P.HIGHEST, P.HIGH),
    "highest_scores_output_high": Precisions(P.HIGH, P.HIGHEST, P.HIGHEST,
                                             P.HIGH),
    "default_scores_output": Precisions(P.DEFAULT, P.HIGHEST, P.HIGHEST,
                                        P.DEFAULT),
}
BOUNDS = dict(o=1e-5, state=1e-5, q=1e-4, k=1e-4, v=1e-4, g=5e-4, beta=5e-4)
NAMES = ("q", "k", "v", "g", "beta")
MATMUL_N = 8192


def inputs(b, t, h, d, dtype="float32", seed=0):
  """Realistic gate inputs: kda_speed's, with dt_bias at the layer's init."""
  q, k, v, g, beta, a_log, _ = kda_speed.make_inputs(b, t, h, d, seed, dtype)
  # dt = exp(U(log 1e-3, log 1e-1)); dt_bias = inverse softplus of dt.
  dt = jnp.exp(jax.random.uniform(jax.random.key(seed + 7), (h * d,),
                                  minval=np.log(1e-3), maxval=np.log(1e-1)))
  dt_bias = dt + jnp.log(-jnp.expm1(-dt))
  return q, k, v, g, beta, a_log, dt_bias


def op(backend="chunked", precision="auto", lower_bound=-5.0,
       group_width=None, final=False):
  """f(q, k, v, g, beta, a_log, dt_bias) -> o, or (o, final state)."""
  def f(q, k, v, g, beta, a_log, dt_bias):
    o, s = ops.kimi_delta_attention(
        q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_gate_in_kernel=True, use_qk_l2norm=True,
        output_final_state=final, backend=backend, precision=precision,
        group_width=group_width)
    return (o, s) if final else o
  return f


def tokamax_mosaic():
  """tokamax's Pallas kernel with its generation check lifted."""
  import tokamax  # pylint: disable=g-import-not-at-top
  inner = kda_speed.tokamax_impl("mosaic")

  def f(*args):
    with tokamax.config.cross_compile(True):
      return inner(*args)
  return f


def with_grads(f):
  """(o, state, grads of q..beta) under fixed random cotangents."""
  def run(*args):
    (o, s), vjp = jax.vjp(lambda *xs: f(*xs, *args[5:]), *args[:5])
    # Drawn in float32 whatever the dtype, so the oracle gets the same ones.
    do = jax.random.normal(jax.random.key(11), o.shape,
                           jnp.float32).astype(o.dtype)
    ds = jax.random.normal(jax.random.key(12), s.shape,
                           jnp.float32).astype(s.dtype)
    return o, s, vjp((do, ds))
  return run


def _cpu():
  return jax.devices("cpu")[0]


def oracle(args, lower_bound):
  """o, state, grads in float64 on the CPU (the reference token scan)."""
  with jax.enable_x64(True), jax.default_device(_cpu()):
    args64 = [jax.device_put(np.asarray(x, np.float64), _cpu()) for x in args]
    fn = with_grads(op("reference", "highest", lower_bound, final=True))
    out = jax.jit(fn)(*args64)
    return jax.tree.map(np.asarray, out)


def _errors(got, want):
  o, s, grads = got
  wo, ws, wgrads = want
  err = {"o": testing.relative_l2_error(np.asarray(o, np.float64), wo),
         "state": testing.relative_l2_error(np.asarray(s, np.float64), ws)}
  for name, x, w in zip(NAMES, grads, wgrads):
    err[name] = testing.relative_l2_error(np.asarray(x, np.float64), w)
  return err


def phase_accuracy(a, save):
  cases = [((2, 1024, 4, 128), -5.0), ((2, 1024, 4, 128), None),
           ((1, 8192, 2, 128), -5.0)]
  if a.smoke:
    cases = [((1, 96, 2, 16), -5.0), ((1, 96, 2, 16), None)]
  rows = []
  for shape, lb in cases:
    args = inputs(*shape)
    start = time.perf_counter()
    want = oracle(args, lb)
    oracle_s = time.perf_counter() - start
    for name, setting in SETTINGS.items():
      fn = jax.jit(with_grads(op("chunked", setting, lb, final=True)))
      try:
        got = jax.block_until_ready(fn(*args))
        err = _errors(got, want)
        ok = all(err[n] <= BOUNDS[n] for n in BOUNDS)
        rows.append(dict(shape=shape, lower_bound=lb, setting=name,
                         errors=err, within_bounds=ok, oracle_s=oracle_s))
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(shape=shape, lower_bound=lb, setting=name,
                         error=repr(e)[:2000]))
      save(rows)
  return rows


def tokamax_with_state(implementation):
  """f(...) -> (o, final state) of tokamax's KDA in our layout."""
  import tokamax  # pylint: disable=g-import-not-at-top

  def f(q, k, v, g, beta, a_log, dt_bias):
    hf = lambda x: jnp.moveaxis(x, 2, 0)
    with tokamax.config.cross_compile(True):
      o, s = tokamax.ops.kimi_delta_attention(
          hf(q), hf(k), hf(v), hf(g), jnp.moveaxis(beta, 2, 0), a_log=a_log,
          delta_time_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.0,
          use_qk_l2norm=True, output_final_state=True,
          implementation=implementation)
    return jnp.moveaxis(o, 0, 2), s[:, 0]
  return f


def phase_mosaic(a, save):
  """tokamax's Pallas kernel (and xla_chunked) against the float64 oracle."""
  shape = (1, 128, 2, 32) if a.smoke else (2, 1024, 4, 128)
  args = inputs(*shape)
  want = oracle(args, -5.0)
  rows = []
  for impl in ("mosaic", "xla_chunked"):
    try:
      got = jax.block_until_ready(jax.jit(with_grads(
          lambda *xs, impl=impl: tokamax_with_state(impl)(*xs)))(*args))
      rows.append(dict(shape=shape, lower_bound=-5.0, setting=f"tokamax_{impl}",
                       errors=_errors(got, want)))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(shape=shape, lower_bound=-5.0,
                       setting=f"tokamax_{impl}", error=repr(e)[:2000]))
    save(rows)
  for r in rows:
    if "errors" in r:
      r["within_bounds"] = all(r["errors"][n] <= BOUNDS[n] for n in BOUNDS)
  save(rows)
  return rows


def _time_group(fns, args, repeats):
  """Compiles, checks, and times fns in rounds; rows keyed by name."""
  compiled, out, info = {}, {}, {}
  for name, fn in fns.items():
    try:
      start = time.perf_counter()
      jfn = jax.jit(fn)
      lowered = jfn.lower(*args).compile()
      mem = lowered.memory_analysis()
      out[name] = jax.block_until_ready(jfn(*args))
      compiled[name] = jfn
      info[name] = dict(compile_s=time.perf_counter() - start,
                        temp_mib=None if mem is None
                        else mem.temp_size_in_bytes / 2**20)
    except Exception as e:  # pylint: disable=broad-except
      info[name] = dict(error=repr(e)[:2000])
      traceback.print_exc()
  times = kda_speed.time_rounds(compiled, args, repeats, warm_calls=1)
  ref = next(iter(out.values()), None)
  for name in compiled:
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32))
                                       for x in jax.tree.leaves(t)])
    info[name].update(
        ms=statistics.median(times[name]) * 1e3,
        ms_rounds=[x * 1e3 for x in times[name]],
        rel_err_vs_first=testing.relative_l2_error(leaves(out[name]),
                                                   leaves(ref)))
    if "tokamax_xla_chunked" in times:
      info[name]["tokamax_xla_chunked_over_this"] = kda_speed.paired(
          times["tokamax_xla_chunked"], times[name])
  return info


def _prepared(b, t, h, d, dtype="float32", seed=0):
  """The kernel's inputs: `inputs` through the op's own preparation."""
  q, k, v, g, beta, a_log, dt_bias = inputs(b, t, h, d, dtype, seed)

  @jax.jit
  def prep(q, k, g, a_log, dt_bias):
    q = gates.l2_normalize(q, dtype=jnp.float32) * d ** -0.5
    k = gates.l2_normalize(k, dtype=jnp.float32)
    g = gates.kda_log_decay(g, a_log, dt_bias, -5.0, dtype=jnp.float32)
    return q.astype(dtype), k.astype(dtype), g
  q, k, g = prep(q, k, g, a_log, dt_bias)
  return q, k, v, g, beta.astype(jnp.float32)


def kernel_fn(precision, heads_per_block=None):
  interpret = jax.devices()[0].platform != "tpu"
  def f(q, k, v, g, beta):
    return pallas_tpu.kda_forward(
        q, k, v, g, beta, precision=precision_lib.resolve(precision, q.dtype),
        heads_per_block=heads_per_block, lower_bound=-5.0,
        interpret=interpret)
  return f


def chunked_fn(precision):
  def f(q, k, v, g, beta):
    return ops.kimi_delta_attention(q, k, v, g, beta, scale=1.0,
                                    output_final_state=True,
                                    backend="chunked", precision=precision)
  return f


def phase_kernel(a, save, rate):
  rows = []
  shape = (1, 128, 2, 128) if a.smoke else (1, 1024, 4, 128)
  args = _prepared(*shape)
  with jax.enable_x64(True), jax.default_device(_cpu()):
    args64 = [jax.device_put(np.asarray(x, np.float64), _cpu())
              for x in args]
    want = jax.tree.map(np.asarray, jax.jit(
        lambda *xs: ops.kimi_delta_attention(
            *xs, scale=1.0, output_final_state=True, backend="reference",
            precision="highest"))(*args64))
  for setting, name in [(s, n) for s in ("highest", "default")
                        for n in ("kernel", "chunked")]:
    fn = (kernel_fn if name == "kernel" else chunked_fn)(setting)
    row = dict(part="accuracy", shape=shape, dtype="float32", impl=name,
               setting=setting)
    try:
      o, s = jax.block_until_ready(jax.jit(fn)(*args))
      row["errors"] = {
          "o": testing.relative_l2_error(np.asarray(o, np.float64), want[0]),
          "state": testing.relative_l2_error(np.asarray(s, np.float64),
                                             want[1])}
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = repr(e)[:2000]
      traceback.print_exc()
    rows.append(row)
    save(rows)
  shape = (1, 256, 4, 128) if a.smoke else (1, 8192, 32, 128)
  args = _prepared(*shape)
  # The smoke (a CPU test of this script) times one setting.
  settings = ("default",) if a.smoke else ("highest", "default")
  for mode in ("forward", "forward+backward"):
    for setting in settings:
      fns = {"chunked": _kernel_mode(chunked_fn(setting), mode)}
      for hb in (1, 2, 4):
        fns[f"kernel_hb{hb}"] = _kernel_mode(kernel_fn(setting, hb), mode)
      info = _time_group(fns, args, a.repeats)
      for name, r in info.items():
        rows.append(dict(part="time", shape=shape, dtype="float32",
                         mode=mode, impl=name, setting=setting,
                         **_rates(r, shape, mode, rate)))
      save(rows)
  return rows


def _kernel_mode(f, mode):
  """f(q, k, v, g, beta) -> (o, state), or its gradients under a loss of o."""
  if mode == "forward":
    return f

  def loss(*args):
    o, state = f(*args)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(state)
  return jax.grad(loss, argnums=tuple(range(5)))


def matmul_rate(n):
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda x: x @ x)
  jax.block_until_ready(f(a))
  best = min(kda_speed.time_rounds({"mm": f}, (a,), 10)["mm"])
  return 2 * n ** 3 / best


def _mode_fn(f, mode):
  return f if mode == "forward" else kda_speed.fwd_bwd(f)


def phase_precision(a, save, rate):
  shape = (1, 256, 4, 32) if a.smoke else (1, 8192, 32, 128)
  rows = []
  for dtype, settings, widths in (
      ("bfloat16", ["default"], (None, 65536)),):
    args = inputs(*shape, dtype=dtype)
    for mode in ("forward", "forward+backward"):
      fns = {f"ours_{s}": _mode_fn(op(precision=SETTINGS[s]), mode)
             for s in settings}
      for w in widths[1:]:
        fns[f"ours_default_gw{w}"] = _mode_fn(op(precision="default",
                                                 group_width=w), mode)
      fns["tokamax_mosaic"] = _mode_fn(tokamax_mosaic(), mode)
      info = _time_group(fns, args, a.repeats)
      for name, r in info.items():
        rows.append(dict(shape=shape, dtype=dtype, mode=mode, impl=name,
                         **_rates(r, shape, mode, rate)))
      save(rows)
  return rows


def _rates(r, shape, mode, rate):
  if "ms" in r:
    flops = kda_speed.kda_flops(*shape) * (1 if mode == "forward" else 3)
    r["fraction_of_bf16_matmul"] = flops / (r["ms"] / 1e3) / rate
  return r


TABLE_SHAPES = ((1, 8192, 32, 128), (8, 4096, 16, 128))
TABLE_DTYPES = ("bfloat16", "float32")


def phase_table(a, save, rate):
  shapes = ([(1, 256, 4, 32), (2, 128, 2, 32)] if a.smoke
            else a.shapes or TABLE_SHAPES)
  rows = []
  for shape in shapes:
    for dtype in a.dtypes or TABLE_DTYPES:
      args = inputs(*shape, dtype=dtype)
      for mode in ("forward", "forward+backward"):
        fns = {"ours_default": _mode_fn(op(precision="default"), mode),
               "ours_highest": _mode_fn(op(precision="highest"), mode),
               "tokamax_xla_chunked": _mode_fn(
                   kda_speed.tokamax_impl("xla_chunked"), mode)}
        if jax.default_backend() == "tpu":  # the Pallas kernels, compiled
          fns["ours_pallas"] = _mode_fn(op(backend="pallas"), mode)
          fns["tokamax_mosaic"] = _mode_fn(tokamax_mosaic(), mode)
        info = _time_group(fns, args, a.repeats)
        for name, r in info.items():
          rows.append(dict(shape=shape, dtype=dtype, mode=mode, impl=name,
                           **_rates(r, shape, mode, rate)))
        save(rows)
  return rows


def markdown(phase, rows, rate):
  if phase == "kernel":
    return "\n".join(json.dumps(r, default=str) for r in rows)
  if phase in ("accuracy", "mosaic"):
    head = ("| B, T, H, K | gate | precision | " + " | ".join(BOUNDS)
            + " | within bounds |")
    lines = [head, "|" + "---|" * (len(BOUNDS) + 4)]
    for r in rows:
      gate = "softplus" if r["lower_bound"] is None else f"lb {r['lower_bound']}"
      if "errors" not in r:
        lines.append(f"| {r['shape']} | {gate} | {r['setting']} | error: "
                     f"{r['error'][:80]} |")
        continue
      errs = " | ".join(f"{r['errors'][n]:.1e}" for n in BOUNDS)
      lines.append(f"| {', '.join(map(str, r['shape']))} | {gate} |"
                   f" {r['setting']} | {errs} | {r['within_bounds']} |")
    return "\n".join(lines)
  lines = [f"bf16 matmul {rate / 1e12:.1f} TFLOP/s ({MATMUL_N}^3)", "",
           "| B, T, H, K | dtype | pass | implementation | ms | xla_chunked /"
           " this | % bf16 peak | temp MiB | rel. err vs first |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    shape = ", ".join(map(str, r["shape"]))
    if "ms" not in r:
      lines.append(f"| {shape} | {r['dtype']} | {r['mode']} | {r['impl']} |"
                   f" failed: {r.get('error', '')[:100]} |")
      continue
    ratio = r.get("tokamax_xla_chunked_over_this")
    mem = r.get("temp_mib")
    lines.append(
        f"| {shape} | {r['dtype']} | {r['mode']} | {r['impl']} |"
        f" {r['ms']:.2f} | {'-' if ratio is None else f'{ratio:.2f}x'} |"
        f" {100 * r['fraction_of_bf16_matmul']:.1f}% |"
        f" {'n/a' if mem is None else f'{mem:.0f}'} |"
        f" {r['rel_err_vs_first']:.1e} |")
  return "\n".join(lines)


def _shapes(text):
  """argparse type: 'B,T,H,K;B,T,H,K' -> [(B, T, H, K), ...]."""
  shapes = [tuple(cli.positive_ints(x)) for x in text.split(";")]
  if any(len(x) != 4 for x in shapes):
    raise argparse.ArgumentTypeError(
        f"must be B,T,H,K shapes separated by ';'; got {text!r}")
  return shapes


def _dtypes(text):
  """argparse type: a comma-separated list of TABLE_DTYPES."""
  dtypes = text.split(",")
  if not set(dtypes) <= set(TABLE_DTYPES):
    raise argparse.ArgumentTypeError(
        f"must be a comma-separated list of {TABLE_DTYPES}; got {text!r}")
  return dtypes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--phase", required=True,
                      choices=("accuracy", "precision", "table", "mosaic",
                               "kernel"))
  parser.add_argument("--repeats", type=cli.positive_int, default=7)
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--shapes", type=_shapes, default=None,
                      help="table: B,T,H,K shapes (K = V) separated by ';'"
                      " (default: both of TABLE_SHAPES)")
  parser.add_argument("--dtypes", type=_dtypes, default=None,
                      help="table: comma-separated, of bfloat16 and float32"
                      " (default: both)")
  parser.add_argument("--out", default="benchmarks/results",
                      type=cli.output_folder)
  a = parser.parse_args()
  os.makedirs(a.out, exist_ok=True)
  path = os.path.join(a.out, f"kda_tpu_{a.phase}.json")
  rate = (None if a.phase in ("accuracy", "mosaic")
          else matmul_rate(512 if a.smoke else MATMUL_N))
  device = jax.devices()[0]
  machine = dict(platform=platform.platform(), device=str(device),
                 device_kind=device.device_kind, jax=jax.__version__,
                 jaxlib=jax.lib.__version__ if hasattr(jax, "lib") else None,
                 bf16_matmul_flops=rate)
  machine["commit"], machine["dirty"] = kda_error_vs_length.git_commit()
  try:
    import libtpu  # pylint: disable=g-import-not-at-top
    machine["libtpu"] = getattr(libtpu, "__version__", None)
  except ImportError:
    machine["libtpu"] = None

  def save(rows):
    with open(path, "w") as f:
      json.dump(dict(machine=machine, phase=a.phase, repeats=a.repeats,
                     rows=rows), f, indent=1, default=str)

  runner = dict(accuracy=lambda: phase_accuracy(a, save),
                mosaic=lambda: phase_mosaic(a, save),
                precision=lambda: phase_precision(a, save, rate),
                table=lambda: phase_table(a, save, rate),
                kernel=lambda: phase_kernel(a, save, rate))[a.phase]
  rows = runner()
  print(markdown(a.phase, rows, rate), flush=True)
  print(f"\nwrote {path}", flush=True)


if __name__ == "__main__":
  cli.run_script(main)
