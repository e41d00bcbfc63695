r"""How exactly the device computes the float32 functions a KDA step uses.

    python -m benchmarks.elementwise_accuracy --out=DIR   # on the device

The token recurrence (the `reference` backend, and a layer's decode) takes
one exp(g) a token, so a rounding that leans one way adds up over tokens,
where the chunked form takes one exponential of a sum a chunk. On a TPU v5e
the float32 recurrence drifted from the other paths by up to 8.0e-5 over
4096 tokens (docs/tpu.md). This measures, on the default device, each
function on a grid of float32 inputs against NumPy in float64:

* `exp` on [-5, 0) (the lower-bound gate's log decays), `exp` on
  [-1e-3, 0) (decays near one), `sigmoid` on [-20, 20], `rsqrt` on
  [1e-3, 1e3] (the L2 norm), `log1p` and `expm1` on [-0.5, 0.5];
* per function: the largest error in units in the last place (ulp, of the
  float32 result), the mean signed relative error (a bias adds up over a
  product, an unbiased error only as its square root) and its mean
  absolute value (where the exact result is not 0);
* `decay_product`: the relative error of exp(g_1) ... exp(g_n) taken as a
  running product on the device, against the float64 product, for n up to
  4096 (g uniform in [-1e-3, 0)): what the recurrence's decays alone lose;
* `gates_exp`, `gates_exp_near_zero`, `gates_exp_wide` ([-87, 0)),
  `gates_exp_positive` ([0, 88)) and `decay_product_gates_exp`: the
  same for `gates.exp`, the float32 exp of multiplies, adds and an exact
  power of two that the recurrence takes instead of `jnp.exp` (on a CPU:
  0.88 ulp at most, mean signed relative error -6.1e-10 on [-5, 0)).

Writes DIR/elementwise_accuracy.json (device, JAX version, commit, rows).
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kda_error_vs_length
from experiments.tools import cli
from linear_attention.ops.kda import gates

F32 = np.float32

# name: (function on the device, function in float64, low, high)
FUNCTIONS = {
    "exp": (jnp.exp, np.exp, -5.0, 0.0),
    "exp_near_zero": (jnp.exp, np.exp, -1e-3, 0.0),
    "gates_exp": (gates.exp, np.exp, -5.0, 0.0),
    "gates_exp_near_zero": (gates.exp, np.exp, -1e-3, 0.0),
    # down to results near the smallest normal; exp(a_log) and g > 0
    "gates_exp_wide": (gates.exp, np.exp, -87.0, 0.0),
    "gates_exp_positive": (gates.exp, np.exp, 0.0, 88.0),
    "sigmoid": (jax.nn.sigmoid, lambda x: 1 / (1 + np.exp(-x)), -20.0, 20.0),
    "rsqrt": (jax.lax.rsqrt, lambda x: 1 / np.sqrt(x), 1e-3, 1e3),
    "log1p": (jnp.log1p, np.log1p, -0.5, 0.5),
    "expm1": (jnp.expm1, np.expm1, -0.5, 0.5),
}
PRODUCT_LENGTHS = (64, 256, 1024, 4096)


def ulps(actual, expected):
  """|actual - expected| in float32 ulps of expected (float64 arrays)."""
  spacing = np.spacing(np.abs(expected).astype(F32)).astype(np.float64)
  return np.abs(actual - expected) / spacing


def measure(name, n=1 << 20):
  """One function's errors on n float32 points spread over its range."""
  device_fn, exact_fn, low, high = FUNCTIONS[name]
  x = np.linspace(low, high, n, endpoint=False, dtype=np.float64).astype(F32)
  y = np.asarray(jax.jit(device_fn)(jnp.asarray(x)), np.float64)
  want = exact_fn(x.astype(np.float64))
  nonzero = want != 0  # relative errors where the result is not 0
  rel = (y - want)[nonzero] / np.abs(want[nonzero])
  return dict(function=name, range=[low, high], points=n,
              max_ulp=float(ulps(y, want).max()),
              mean_signed_rel=float(rel.mean()),
              mean_abs_rel=float(np.abs(rel).mean()))


def decay_product(lengths=PRODUCT_LENGTHS, seed=0, exp=jnp.exp):
  """Relative error of a running product of device `exp`s, per length."""
  rng = np.random.default_rng(seed)
  g = rng.uniform(-1e-3, 0.0, (256, max(lengths))).astype(F32)

  @jax.jit
  def running(g):
    def step(p, g_t):
      p = p * exp(g_t)
      return p, p
    _, ps = jax.lax.scan(step, jnp.ones(g.shape[0], jnp.float32), g.T)
    return ps.T

  got = np.asarray(running(jnp.asarray(g)), np.float64)
  want = np.exp(np.cumsum(g.astype(np.float64), axis=1))
  rel = (got - want) / want
  return [dict(n=n, mean_signed_rel=float(rel[:, n - 1].mean()),
               max_abs_rel=float(np.abs(rel[:, n - 1]).max()))
          for n in lengths]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="elementwise_accuracy",
                 type=cli.output_folder)
  p.add_argument("--points", type=cli.positive_int, default=1 << 20)
  a = p.parse_args()
  rows = [measure(name, a.points) for name in FUNCTIONS]
  commit, dirty = kda_error_vs_length.git_commit()
  report = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                commit=commit, dirty=dirty, functions=rows,
                decay_product=decay_product(),
                decay_product_gates_exp=decay_product(exp=gates.exp))
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "elementwise_accuracy.json"), "w") as fh:
    json.dump(report, fh, indent=1)
  for r in rows:
    print(f"{r['function']:>19}: max {r['max_ulp']:.1f} ulp, mean signed"
          f" {r['mean_signed_rel']:+.2e}, mean |rel| {r['mean_abs_rel']:.2e}")
  for key in ("decay_product", "decay_product_gates_exp"):
    for r in report[key]:
      print(f"  {key}, {r['n']:>4} exps: mean signed"
            f" {r['mean_signed_rel']:+.2e}, max |rel| {r['max_abs_rel']:.2e}")


if __name__ == "__main__":
  cli.run_script(main)
