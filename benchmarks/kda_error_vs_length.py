r"""How the `chunked` KDA backend's error grows with sequence length.

    nice -n 5 .venv/bin/python -m benchmarks.kda_error_vs_length \
        [--lengths=64,256,1024,4096,16384,65536] [--out=benchmarks/results/kda_error_vs_length]

For each T: inputs drawn by NumPy in float64 (B = 1, H heads, K = V; q, k,
v, the raw gate and the initial state N(0, 1), beta = sigmoid(N(0, 1)),
a_log = log U(1, 16), dt_bias N(0, 1)), the lower-bound gate fused in the op,
q/k L2 norm, a random initial state. The loss is
`sum(o * do) + sum(final_state * ds)` with random float64 cotangents do, ds.

Oracle: the `reference` backend (token-by-token `lax.scan`) in float64 under
`jax.enable_x64(True)`, on the host's CPU whatever the default device (on a TPU
host the cases run on the chip, the oracle beside them): output, final state
and the gradients of the loss with respect to q, k, v, g (raw gate), beta,
a_log, dt_bias and the initial state. Past `--oracle_segment` tokens the oracle
runs the same recurrence as a scan over segments, each a `jax.checkpoint`ed
reference call that takes the previous segment's final state as its initial
state: the same arithmetic, but the backward stores one state per segment
instead of a few per token (a float64 state is 64 KiB per head at K = V = 64;
65536 tokens would need over 10 GiB of residuals).

Under test (x64 off, as in training), each against the oracle:
* `chunked_f32`: `chunked` on the inputs rounded to float32;
* `chunked_bf16`: `chunked` with q, k, v, g, beta in bfloat16 (a_log,
  dt_bias, initial state float32): its output is bfloat16, the loss is
  taken in float32 (`sum(o.astype(f32) * do) + sum(s * ds)`);
* `reference_f32` (baseline, same segmenting as the oracle): the token-by-token
  recurrence on the float32 inputs, to tell the chunked form's own error
  from what any float32 evaluation of the recurrence loses.
Every error includes the rounding of the inputs to the dtype under test
(the oracle sees the float64 inputs).

Metric: relative L2 error ||x - x_ref|| / ||x_ref|| per quantity. Results go
to `<out>.json` (machine, jax version, git commit, flags, errors and wall
times per T), `<out>.md` (one table per case, rows T; the last row is the
least-squares slope of log(error) against log(T): 0.5 is sqrt(T) growth,
1 linear) and `<out>.png` (log-log, one panel per case, one line per
quantity). All three are rewritten after every T.
"""

import json
import os
import platform
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments.tools import cli
from linear_attention import ops
from linear_attention import testing

_LENGTHS = flags.DEFINE_list(
    "lengths", ["64", "256", "1024", "4096", "16384", "65536"],
    "sequence lengths T")
_HEADS = flags.DEFINE_integer("heads", 2, "H", lower_bound=1)
_DIM = flags.DEFINE_integer("dim", 64, "K = V", lower_bound=1)
_LOWER_BOUND = flags.DEFINE_float("lower_bound", -5.0,
                                  "lower bound of the fused gate")
_SEED = flags.DEFINE_integer("seed", 0, "NumPy seed (with T)")
_CASES = flags.DEFINE_list(
    "cases", ["chunked_f32", "chunked_bf16", "reference_f32"],
    "what is measured against the float64 oracle")
_ORACLE_SEGMENT = flags.DEFINE_integer(
    "oracle_segment", 4096,
    "tokens per checkpointed reference call (oracle and reference_f32)",
    lower_bound=1)
_OUT = flags.DEFINE_string(
    "out", "benchmarks/results/kda_error_vs_length",
    "output path without extension (.json, .md, .png)")
_ALL_FLAGS = (_LENGTHS, _HEADS, _DIM, _LOWER_BOUND, _SEED, _CASES,
              _ORACLE_SEGMENT, _OUT)

ARG_NAMES = ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "initial_state")
QUANTITIES = ("output", "state") + tuple("d" + n for n in ARG_NAMES)

# case -> (backend, dtype of q, k, v, g, beta; of a_log, dt_bias, state)
CASES = {
    "chunked_f32": ("chunked", jnp.float32, jnp.float32),
    "chunked_bf16": ("chunked", jnp.bfloat16, jnp.float32),
    "reference_f32": ("reference", jnp.float32, jnp.float32),
}


def make_inputs(t, h, d, seed):
  """(args in ARG_NAMES order, (do, ds)), float64 NumPy arrays."""
  rng = np.random.default_rng((seed, t))
  normal = lambda *shape: rng.standard_normal(shape)
  args = (
      normal(1, t, h, d),  # q
      normal(1, t, h, d),  # k
      normal(1, t, h, d),  # v
      normal(1, t, h, d),  # g (raw gate)
      1 / (1 + np.exp(-normal(1, t, h))),  # beta
      np.log(rng.uniform(1, 16, (h,))),  # a_log
      normal(h * d),  # dt_bias
      normal(1, h, d, d),  # initial_state
  )
  cotangents = (normal(1, t, h, d), normal(1, h, d, d))  # do, ds
  return args, cotangents


def kda(backend, q, k, v, g, beta, a_log, dt_bias, initial_state):
  return ops.kimi_delta_attention(
      q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
      lower_bound=_LOWER_BOUND.value, use_gate_in_kernel=True,
      use_qk_l2norm=True, initial_state=initial_state,
      output_final_state=True, backend=backend)


def kda_in_segments(backend, segment, q, k, v, g, beta, a_log, dt_bias,
                    initial_state):
  """`kda`, as a scan over checkpointed calls of `segment` tokens each.

  Exact for the token-by-token reference (each segment starts from the
  previous one's final state); the backward keeps one state per segment.
  """
  t = q.shape[1]
  if t <= segment:
    return kda(backend, q, k, v, g, beta, a_log, dt_bias, initial_state)
  if t % segment:
    raise ValueError(f"T = {t} is not a multiple of --oracle_segment ="
                     f" {segment}")
  n = t // segment
  # [B, T, ...] -> [n, B, segment, ...]
  split = lambda x: jnp.moveaxis(
      x.reshape(x.shape[0], n, segment, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def step(state, xs):
    o, state = kda(backend, *xs, a_log, dt_bias, state)
    return state, o

  state, o = jax.lax.scan(step, initial_state,
                          tuple(map(split, (q, k, v, g, beta))))
  o = jnp.moveaxis(o, 0, 1).reshape(q.shape[0], t, *o.shape[3:])
  return o, state


def value_and_grads(backend, segment=None):
  """Jitted (args, do, ds) -> (o, final_state, grads of the loss)."""
  def loss(*args_and_cotangents):
    *args, do, ds = args_and_cotangents
    if segment is None:
      o, s = kda(backend, *args)
    else:
      o, s = kda_in_segments(backend, segment, *args)
    # In the state's (compute) dtype: float32, or float64 for the oracle.
    return jnp.sum(o.astype(s.dtype) * do) + jnp.sum(s * ds), (o, s)

  grad = jax.grad(loss, argnums=tuple(range(len(ARG_NAMES))), has_aux=True)

  @jax.jit
  def f(args, do, ds):
    grads, (o, s) = grad(*args, do, ds)
    return o, s, grads
  return f


def to_numpy(o, s, grads):
  """{quantity: float64 NumPy array}."""
  values = (o, s) + tuple(grads)
  return {name: np.asarray(jax.device_get(x), np.float64)
          for name, x in zip(QUANTITIES, values)}


def check_dtypes(name, o, s, grads, expected):
  """Exits when any result is not in the dtype `expected` maps it to."""
  values = dict(zip(QUANTITIES, (o, s) + tuple(grads)))
  bad = {q: str(x.dtype) for q, x in values.items()
         if x.dtype != expected(q)}
  if bad:
    sys.exit(f"error: {name} returned unexpected dtypes {bad}")


def run_oracle(args, cotangents):
  """Float64 reference on the host's CPU (an accelerator's float64, where it
  has one, is emulated or absent): ({quantity: array}, seconds). x64 on
  inside."""
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    if jnp.zeros((), jnp.float64).dtype != jnp.float64:
      sys.exit("error: float64 is unavailable even under"
               " jax.enable_x64(True); the float64 oracle cannot run")
    f = value_and_grads("reference", segment=_ORACLE_SEGMENT.value)
    args = tuple(jnp.asarray(x, jnp.float64) for x in args)
    do, ds = (jnp.asarray(x, jnp.float64) for x in cotangents)
    start = time.perf_counter()
    o, s, grads = jax.block_until_ready(f(args, do, ds))
    seconds = time.perf_counter() - start
    check_dtypes("the float64 oracle", o, s, grads,
                 lambda q: jnp.dtype(jnp.float64))
    return to_numpy(o, s, grads), seconds


def run_case(case, args, cotangents):
  """One case under test, x64 off: ({quantity: array}, seconds)."""
  backend, seq_dtype, param_dtype = CASES[case]
  segment = _ORACLE_SEGMENT.value if backend == "reference" else None
  with jax.enable_x64(False):
    f = value_and_grads(backend, segment)
    # f64 -> f32 -> bf16 is the same rounding as f64 -> bf16 except at
    # rare double-rounding ties; inputs are rounded once, from float64.
    args = tuple(
        jnp.asarray(np.asarray(x, seq_dtype if i < 5 else param_dtype))
        for i, x in enumerate(args))
    do, ds = (jnp.asarray(x, jnp.float32) for x in cotangents)
    start = time.perf_counter()
    o, s, grads = jax.block_until_ready(f(args, do, ds))
    seconds = time.perf_counter() - start
  param_names = ("a_log", "dt_bias", "initial_state")
  check_dtypes(case, o, s, grads, lambda q: jnp.dtype(
      jnp.float32 if q == "state" or q[1:] in param_names else seq_dtype))
  return to_numpy(o, s, grads), seconds


def slope(lengths, errors):
  """Least-squares slope of log(error) against log(T); None if undefined."""
  pairs = [(t, e) for t, e in zip(lengths, errors) if e > 0]
  if len(pairs) < 2:
    return None
  x, y = np.log([p[0] for p in pairs]), np.log([p[1] for p in pairs])
  return float(np.polyfit(x, y, 1)[0])


def markdown(rows, cases):
  lines = []
  for case in cases:
    done = [r for r in rows if case in r["errors"]]
    lines += [f"### {case} vs float64 reference (relative L2 error)", "",
              "| T | " + " | ".join(QUANTITIES) + " |",
              "|---:|" + "---:|" * len(QUANTITIES)]
    for r in done:
      errs = r["errors"][case]
      lines.append(f"| {r['T']} | "
                   + " | ".join(f"{errs[q]:.1e}" for q in QUANTITIES) + " |")
    slopes = [slope([r["T"] for r in done],
                    [r["errors"][case][q] for r in done]) for q in QUANTITIES]
    if len(done) >= 2:
      lines.append("| slope | " + " | ".join(
          "n/a" if s is None else f"{s:.2f}" for s in slopes) + " |")
    lines.append("")
  lines += ["### wall seconds (compile + one run)", "",
            "| T | oracle (f64 reference) | " + " | ".join(cases) + " |",
            "|---:|---:|" + "---:|" * len(cases)]
  for r in rows:
    secs = r["seconds"]
    lines.append(f"| {r['T']} | {secs['oracle']:.1f} | " + " | ".join(
        f"{secs[c]:.1f}" if c in secs else "" for c in cases) + " |")
  return "\n".join(lines) + "\n"


def plot(rows, cases, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 5),
                           sharey=True, squeeze=False)
  for ax, case in zip(axes[0], cases):
    done = [r for r in rows if case in r["errors"]]
    ts = np.array([r["T"] for r in done], float)
    for i, q in enumerate(QUANTITIES):
      ax.loglog(ts, [r["errors"][case][q] for r in done], marker="o",
                color=plt.cm.tab10(i), label=q)
    if len(ts):  # a sqrt(T) guide through the output's first point
      first = done[0]["errors"][case]["output"]
      ax.loglog(ts, first * np.sqrt(ts / ts[0]), "k--", lw=0.8,
                label="∝ sqrt(T)")
    ax.set_title(f"{case} vs float64 reference")
    ax.set_xlabel("T (tokens)")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("relative L2 error")
  axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def git_commit():
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"],
                                capture_output=True, text=True,
                                check=True).stdout.strip())
  except (OSError, subprocess.CalledProcessError):
    return None, None
  return commit, dirty


def main(argv):
  del argv
  try:
    lengths = [int(t) for t in _LENGTHS.value]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    raise app.UsageError(f"--lengths must be ints >= 1; got"
                         f" {','.join(_LENGTHS.value)!r}.")
  cases = list(_CASES.value)
  if not cases:
    raise app.UsageError(f"--cases is empty; known: {list(CASES)}")
  unknown = sorted(set(cases) - set(CASES))
  if unknown:
    raise app.UsageError(f"unknown --cases {unknown}; known: {list(CASES)}")
  # Fail before any work if float64 is unavailable.
  with jax.enable_x64(True):
    if jnp.zeros((), jnp.float64).dtype != jnp.float64:
      sys.exit("error: jax.enable_x64(True) did not enable float64; the"
               " float64 oracle cannot run")
  commit, dirty = git_commit()
  header = dict(
      machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                   device=str(jax.devices()[0]), jax=jax.__version__),
      jax_version=jax.__version__, git_commit=commit, git_dirty=dirty,
      flags={f.name: f.value for f in _ALL_FLAGS},
      shape=dict(B=1, H=_HEADS.value, K=_DIM.value, V=_DIM.value),
      quantities=list(QUANTITIES))
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  rows = []

  def save():  # after every T, so an interrupted run keeps the rest
    with open(_OUT.value + ".json", "w") as f:
      json.dump(dict(header, rows=rows), f, indent=1)
    with open(_OUT.value + ".md", "w") as f:
      f.write(markdown(rows, cases))
    plot(rows, cases, _OUT.value + ".png")
    logging.info("wrote %s.{json,md,png}", _OUT.value)

  for t in lengths:
    args, cotangents = make_inputs(t, _HEADS.value, _DIM.value, _SEED.value)
    oracle, seconds = run_oracle(args, cotangents)
    logging.info("T=%d: float64 oracle in %.1f s", t, seconds)
    row = dict(T=t, errors={}, seconds=dict(oracle=seconds))
    rows.append(row)
    for case in cases:
      got, seconds = run_case(case, args, cotangents)
      row["seconds"][case] = seconds
      row["errors"][case] = {
          q: testing.relative_l2_error(got[q], oracle[q]) for q in QUANTITIES}
      logging.info("T=%d %s (%.1f s): %s", t, case, seconds, " ".join(
          f"{q}={e:.1e}" for q, e in row["errors"][case].items()))
      save()
  print(markdown(rows, cases), flush=True)


if __name__ == "__main__":
  cli.run(main)
