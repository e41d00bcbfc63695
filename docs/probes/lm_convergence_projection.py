"""How far the language model would have to train to meet the convergence rule.

The rule (experiments/training/metrics.py, `loss_status`): held-out bits per
byte fall by less than 0.005 over the last tenth of the steps. No run of
results/text meets it at the 6000-step cap. This fits bits(s) = a + b * s**-c to
each run's held-out evaluations from step 2000 on (past the hybrid's drop
between 1000 and 2000), by least squares, and solves for the first step N with
bits(0.9 N) - bits(N) < 0.005. An extrapolation of a three-parameter fit over
one decade of steps: read it as an order of magnitude, not a prediction.

Then a check of the extrapolation on the runs continued past the cap
(results/text/past_cap/, each from its 6000-step checkpoint, by the sweep's
loss rule up to 12000 steps): held-out bits per byte per 600-step window,
the rule's two measures at the last step, and the fit's value there.

    .venv/bin/python docs/probes/lm_convergence_projection.py
Output: docs/probes/lm_convergence_projection.txt. Kept as it ran.
"""
import glob
import json
import math
import os

import numpy as np
from scipy import optimize

from experiments.training import metrics

FALL, FIRST = metrics.CONVERGE_FALL, 2000
here = os.path.dirname(os.path.abspath(__file__))
runs = sorted(glob.glob(os.path.join(here, "../../results/text/text_T256/*")))
fits = {}
print(f"{'run':32s} {'a':>6s} {'b':>8s} {'c':>5s} {'rms':>7s}"
      f" {"measured":>9s} {"fit fall":>8s} {'N':>9s} {'bits(N)':>7s}")
for run in runs:
  with open(os.path.join(run, "metrics.jsonl")) as f:
    evals = [r for r in map(json.loads, f) if r["split"] == "eval"]
  s = np.array([r["step"] for r in evals if r["step"] >= FIRST], float)
  y = np.array([r["loss"] for r in evals if r["step"] >= FIRST]) / math.log(2)
  curve = lambda t, a, b, c: a + b * t ** -c
  (a, b, c), _ = optimize.curve_fit(curve, s, y, p0=(y[-1] - 0.1, 10., 0.5),
                                    maxfev=20000)
  rms = float(np.sqrt(np.mean((curve(s, a, b, c) - y) ** 2)))
  fits[os.path.basename(run)] = (a, b, c)
  fall = lambda n: curve(0.9 * n, a, b, c) - curve(n, a, b, c)
  last = s >= 5400  # the measured fall: the least-squares line, 5400-6000
  slope = np.polyfit(s[last], y[last], 1)[0]
  measured = -slope * 600
  n = next((int(m) for m in np.geomspace(6000, 1e8, 2000) if fall(m) < FALL),
           None)
  print(f"{os.path.basename(run):32s} {a:6.3f} {b:8.2f} {c:5.2f} {rms:7.4f}"
        f" {measured:9.4f} {fall(6000):8.4f}"
        f" {n if n else '>1e8':>9} {curve(n, a, b, c) if n else float('nan'):7.3f}"
        + ("  no floor: a < 0, the fit is log-like" if a < 0 else ""))

for run in sorted(glob.glob(os.path.join(
    here, "../../results/text/past_cap/text_T256/*"))):
  name = os.path.basename(run)
  with open(os.path.join(run, "metrics.jsonl")) as f:
    evals = [r for r in map(json.loads, f) if r["split"] == "eval"]
  s = np.array([r["step"] for r in evals], float)
  y = np.array([r["loss"] for r in evals]) / math.log(2)
  n = s[-1]
  print(f"\n{name} past the cap, to {n:.0f}: the fall of the least-squares"
        " line over each 600-step window, and its lowest evaluation")
  for lo in range(6000, int(n), 600):
    w = (s >= lo) & (s <= lo + 600)
    print(f"  {lo}-{lo + 600}: fall {-np.polyfit(s[w], y[w], 1)[0] * 600:7.4f}"
          f"  lowest {y[w].min():.4f}")
  # The rule's own two measures (experiments/training/metrics.py) on this run.
  line, lowest = metrics._window_change(  # pylint: disable=protected-access
      [dict(step=r["step"], minus_bits=-r["loss"] / math.log(2))
       for r in evals], "minus_bits", metrics.CONVERGE_FRACTION)
  print(f"at {n:.0f}: line fall over the last tenth {line:.4f}, lowest of the"
        f" tenth before minus lowest of the last {lowest:.4f} (the rule: both"
        f" < {FALL}): {metrics.loss_status(evals)}")
  a, b, c = fits[name]
  print(f"bits per byte at {n:.0f}: {y[-1]:.4f} measured, {a + b * n ** -c:.4f}"
        f" the fit's (its floor a = {a:.3f})")
