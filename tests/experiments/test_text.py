"""The byte-level text task: corpus split, packed windows, training on it.

Each test writes its own small corpus (files of printable bytes), or reads
the module's one trained run on one (`text_run`); the windows are checked
against the files read back independently.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import text as text_config
from configs.sweeps import kimi_synthetic
from experiments import tasks
from experiments.sweeps import sweep_lib
from experiments.tasks import text as text_lib
from experiments.tools import generation
from experiments.training import program as program_lib
from experiments.training import train


REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _corpus(root, n=300, seed=0):
  rng = np.random.default_rng(seed)
  for i in range(n):
    sub = os.path.join(root, f"pkg{i % 4}")
    os.makedirs(sub, exist_ok=True)
    size = int(rng.integers(20, 200))
    body = bytes(rng.integers(32, 127, size).astype(np.uint8))
    with open(os.path.join(sub, f"m{i}.py"), "wb") as f:
      f.write(body)
  os.makedirs(os.path.join(root, "site-packages"), exist_ok=True)
  with open(os.path.join(root, "site-packages", "x.py"), "w") as f:
    f.write("not the standard library")
  return root


def _stream(root, held_out):
  """The split's bytes and each byte's file, read directly."""
  files = sorted(
      os.path.relpath(os.path.join(r, f), root)
      for r, _, fs in os.walk(root) for f in fs
      if f.endswith(".py") and "site-packages" not in r)
  data, owner = b"", []
  for i, rel in enumerate(files):
    if text_lib.is_held_out(rel) == held_out:
      with open(os.path.join(root, rel), "rb") as f:
        body = f.read()
      data += body
      owner += [i] * len(body)
  return np.frombuffer(data, np.uint8), np.asarray(owner)


def _same_bytes_config(root, cache, lengths=(64, 128), score_last=16):
  config = text_config.get_config("smoke")
  config.task.source_dir = root
  config.task.cache_dir = cache
  config.train.eval_lengths = lengths
  config.train.eval_score_last = score_last
  config.train.eval_batches = 2
  return config


# The xdist group of the tests that read `text_run`: one worker, one
# training. Where the group is not honoured (pytest-xdist 3.8.0 under
# pytest 9.2 drops it: pytest-xdist#1386) each worker trains the run once,
# the second finding its programs in the suite's compilation cache.
TEXT_RUN = "text_run"


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
  """(source dir, config, workdir, summary): one smoke run, trained once per
  test process for the tests that read a finished run (its record, the
  text it generates, its bits per byte by hand); training is most of their
  time. Held-out bits per byte at T = 32, 64 and 128, every length scoring
  the last 16 bytes of one batch of 4 windows (the smoke config's batch:
  its programs at T = 32 and 64 are the smoke sweep's). A test that
  changes the source dir puts it back."""
  tmp = tmp_path_factory.mktemp("text_run")
  root = _corpus(str(tmp / "src"), n=400)
  config = _same_bytes_config(root, str(tmp / "cache"))
  config.train.eval_batches = 1
  workdir = str(tmp / "run")
  return root, config, workdir, train.train_and_evaluate(config, workdir)


def test_windows_are_the_files_packed_with_their_boundaries(tmp_path):
  root = _corpus(str(tmp_path / "src"))
  task = tasks.make_task(name="text", seq_len=64, source_dir=root,
                         cache_dir=str(tmp_path / "cache"))
  fp = task.fingerprint()
  assert fp["files"] == 300  # site-packages left out
  assert fp["splits"]["train"]["files"] + fp["splits"]["held_out"][
      "files"] == 300 and fp["splits"]["held_out"]["files"] >= 1
  for split, held in ((task, False), (tasks.held_out(task), True)):
    data, owner = _stream(root, held)
    b = split.sample(tasks.rng(0, 0, 3), 16)
    again = split.sample(tasks.rng(0, 0, 3), 16)
    # exact (and below): integer NumPy windows of the corpus's bytes.
    np.testing.assert_array_equal(b.inputs, again.inputs)
    for row in range(16):  # find the window in the stream
      x = np.append(b.inputs[row], b.targets[row, -1]).astype(np.uint8)
      hits = [s for s in range(len(data) - 64)
              if np.array_equal(data[s:s + 65], x)]
      assert hits, row
      s = hits[0]
      files = owner[s:s + 65]
      np.testing.assert_array_equal(  # ids number the files along the row
          np.unique(files[:64], return_inverse=True)[1] + 1,
          b.segment_ids[row])
      np.testing.assert_array_equal(b.mask[row], files[1:] == files[:64])


def test_held_out_files_are_not_trained_on():
  rels = [f"lib/m{i}.py" for i in range(5000)]
  held = [r for r in rels if text_lib.is_held_out(r)]
  assert 0.01 < len(held) / len(rels) < 0.03


@pytest.mark.xdist_group(TEXT_RUN)
def test_text_run_records_its_corpus_and_refuses_another(text_run):
  root, config, workdir, summary = text_run
  assert summary["corpus"]["files"] == 400
  assert set(summary["length_loss"]) == {
      str(n) for n in config.train.eval_lengths}
  with open(os.path.join(workdir, "corpus.json")) as f:
    assert json.load(f) == summary["corpus"]
  # Generation from the run: the CLI prints the prompt and its continuation
  # (the workdir given relative to where it runs). It runs on the host's
  # CPU: one process at a time holds a TPU, and this one may.
  # `--compilation_cache_dir=`: nothing under ~/.cache; the environment
  # names the test's cache, where continue_text below finds the CLI's
  # compiled generate (a cached program is the compiled one, bit for bit).
  out = subprocess.run(
      [sys.executable, "-m", "experiments.generate",
       f"--workdir={os.path.relpath(workdir, REPO)}",
       "--prompt=def f(", "--max_new_tokens=12", "--temperature=0.8",
       "--top_k=5", "--seed=1", "--compilation_cache_dir="], cwd=REPO,
      capture_output=True, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("def f(") and len(out.stdout) > len("def f(")
  again = generation.continue_text(workdir, "def f(", max_new_tokens=12,
                                 temperature=0.8, top_k=5, seed=1)
  if jax.default_backend() == "cpu":
    # exact: the CLI runs continue_text: the same jitted generate (the same
    # HLO, on this machine) on the same checkpoint, prompt and seed. On
    # another backend this process's generate is another platform's
    # program (sampled at temperature 0.8), so only the CLI's form is
    # checked there.
    assert out.stdout.rstrip("\n") == "def f(" + again.rstrip("\n")
  with pytest.raises(ValueError, match="temperature"):
    generation.continue_text(workdir, "x", max_new_tokens=2, temperature=-1.0,
                           top_k=0, seed=0)
  # The same config on other files (another Python's standard library):
  # one file edited, then put back (and the corpus read again) for the
  # other tests of the shared run, whose workdir the refusal leaves as it
  # was.
  path = os.path.join(root, "pkg0", "m0.py")
  files = sorted(os.listdir(workdir))
  with open(path, "rb") as f:
    body = f.read()
  try:
    with open(path, "ab") as f:
      f.write(b"# edited")
    text_lib.load_corpus.cache_clear()
    with pytest.raises(ValueError, match="another corpus"):
      train.train_and_evaluate(config, workdir)
    assert sorted(os.listdir(workdir)) == files
  finally:
    with open(path, "wb") as f:
      f.write(body)
    text_lib.load_corpus.cache_clear()


def test_the_text_sweeps_models_match_in_size():
  from configs.sweeps import text as text_sweep
  from experiments.sweeps import sweep_lib
  from experiments.training import model as model_lib
  import jax
  import jax.numpy as jnp
  counts = {}
  for run in sweep_lib.expand(text_sweep.get_config()):
    f = model_lib.make_model(run.config.model, 256)
    params = jax.eval_shape(f.init, jax.random.key(0),
                            jnp.zeros((1, 8), jnp.int32))
    counts[run.mixer] = model_lib.count_params(params)
  assert set(counts) == set(text_sweep.MLP_HIDDEN)
  assert max(counts.values()) / min(counts.values()) < 1.01, counts


# In `text_run`'s group though it trains its own run: its first pass is
# the shared run's programs (the training step, the evaluation at T = 32
# and 64 on 4 windows), which this process then finds compiled in the
# suite's compilation cache instead of compiling them again.
@pytest.mark.xdist_group(TEXT_RUN)
def test_text_sweep_reports_bits_per_byte_per_length(tmp_path):
  from configs.sweeps import text as text_sweep
  from experiments.sweeps import sweep_lib
  from experiments.sweeps import sweep_report
  from experiments.training import metrics as metrics_lib
  root = _corpus(str(tmp_path / "src"))
  sweep = text_sweep.get_config("smoke")
  task = dict(sweep.cells[0]["task"], source_dir=root,
              cache_dir=str(tmp_path / "cache"))
  sweep.cells = (dict(sweep.cells[0], task=task),)
  sweep.mixers = ("hybrid",)  # one run: the report is what is tested
  workdir = str(tmp_path / "sweep")
  sweep_lib.run_sweep(sweep, workdir, code_version="test")
  # Its held-out bits per byte decide its status (the loss rule): 4 steps
  # are short of the 2000 a run needs to converge, so it is extended, 4
  # steps at a time, to the cap of 8.
  (name,) = [r.name for r in sweep_lib.expand(sweep)]
  trained = sweep_lib.run_sweep(sweep, workdir, extend_to=8, extend_step=4)
  assert [r.config.train.num_steps for r in trained] == [8]
  with open(os.path.join(workdir, name, "summary.json")) as f:
    assert json.load(f)["steps"] == 8
  results = sweep_report.aggregate(sweep, workdir)
  assert results["num_finished"] == 1 and len(results["cells"]) == 1
  assert results["runs"][0]["status"] == "falling at cap"
  assert results["cells"][0]["statuses"] == {"falling at cap": 1}
  for run in results["runs"]:  # bits = the run's own logged losses / ln 2
    records = metrics_lib.read_records(
        os.path.join(workdir, run["name"], "metrics.jsonl"))
    last_eval = [r for r in records if r["split"] == "eval"][-1]
    with open(os.path.join(workdir, run["name"], "summary.json")) as f:
      lengths = json.load(f)["length_loss"]
    want = {"32": last_eval["loss"] / np.log(2),
            **{n: v / np.log(2) for n, v in lengths.items()}}
    assert run["bits_per_byte"].keys() == want.keys()
    np.testing.assert_allclose([run["bits_per_byte"][n] for n in want],
                               list(want.values()), rtol=1e-12)
    assert 0 < min(want.values()) and max(want.values()) < 9  # <= 8 + noise
  for cell in results["cells"]:  # one seed: mean = min = max = the run's
    run = next(r for r in results["runs"]
               if r["name"].split("/")[1].startswith(cell["mixer"] + "_"))
    assert cell["num_params"] == run["num_params"]
    for n, value in run["bits_per_byte"].items():
      assert cell["bits_per_byte"][n]["mean"] == pytest.approx(value)
  with open(os.path.join(workdir, "results.md")) as f:
    md = f.read()
  assert "bits per byte" in md and "| T=32 | T=64 |" in md
  assert "converged (at least 2000 steps" in md
  for name in ("bits_per_byte_vs_length.png", "bits_per_byte_curves_T32.png"):
    assert os.path.exists(os.path.join(workdir, name)), name


def test_every_evaluation_length_scores_the_same_bytes(tmp_path):
  root = _corpus(str(tmp_path / "src"), n=400)
  config = _same_bytes_config(root, str(tmp_path / "cache"))
  data, owner = _stream(root, held_out=True)
  ends, scored = {}, {}
  for seq_len in (32, 64, 128):  # the training length and eval_lengths
    task = tasks.make_task(**dict(config.task.to_dict(), seq_len=seq_len))
    batches = train.eval_set(config, task)
    assert len(batches) == 2
    for i, b in enumerate(batches):
      assert b["inputs"].shape == (4, seq_len)
      for row in range(4):  # the window, found in the held-out bytes
        x = np.append(b["inputs"][row], b["targets"][row, -1]).astype(
            np.uint8)
        hits = [s for s in range(len(data) - seq_len)
                if np.array_equal(data[s:s + seq_len + 1], x)]
        assert hits, (seq_len, i, row)
        end = hits[0] + seq_len  # the window's last byte
        ends.setdefault((i, row), set()).add(end)
        files = owner[end - seq_len:end + 1]
        # Scored: the last 16 targets, but no file's last byte.
        want = (np.arange(seq_len) >= seq_len - 16) & (files[1:] == files[:-1])
        np.testing.assert_array_equal(b["mask"][row], want)
        np.testing.assert_array_equal(
            np.unique(files[:-1], return_inverse=True)[1] + 1,
            b["segment_ids"][row])
        scored.setdefault((i, row), []).append(
            b["targets"][row][want].tolist())
  # Every length's window ends at one byte, so each scores the same bytes.
  for key, found in ends.items():
    assert len(found) == 1, key
    assert all(s == scored[key][0] for s in scored[key]), key
  assert sum(len(s[0]) for s in scored.values()) > 0
  bad = _same_bytes_config(root, str(tmp_path / "cache"), score_last=40)
  with pytest.raises(ValueError, match="train.eval_score_last"):
    program_lib.validate_config(bad)
  stack = sweep_lib.expand(kimi_synthetic.get_config("smoke"))[0].config
  stack.train.eval_score_last = 8  # a Stack window cut short is no window
  with pytest.raises(ValueError, match="train.eval_score_last must be None"
                     " for a task whose windows cannot be cut"):
    program_lib.validate_config(stack)


@pytest.mark.xdist_group(TEXT_RUN)
def test_bits_per_byte_at_each_length_match_a_hand_computation(text_run):
  """One held-out batch of 4 windows; the run's bits per byte at each
  length against the model's logits on windows built from the files
  directly (the mean over every scored byte of the 4)."""
  root, config, workdir, summary = text_run
  data, owner = _stream(root, held_out=True)
  (longest,) = train.eval_set(config, tasks.make_task(
      **dict(config.task.to_dict(), seq_len=128)))
  assert longest["inputs"].shape == (4, 128)
  ends = []  # each window's last byte in the held-out stream
  for inputs, targets in zip(longest["inputs"], longest["targets"]):
    x = np.append(inputs, targets[-1]).astype(np.uint8)
    (start,) = [s for s in range(len(data) - 128)
                if np.array_equal(data[s:s + 129], x)][:1]
    ends.append(start + 128)
  _, model, params, step = generation.load_run(workdir)
  assert step == summary["steps"] == 4
  # Compiled, once a length: op by op the model takes twice as long here.
  apply = jax.jit(model.apply)
  got = dict(summary["length_loss"], **{"32": summary["final_eval_loss"]})
  for seq_len in (32, 64, 128):
    window = np.stack([data[e - seq_len:e + 1] for e in ends]).astype(
        np.int32)
    files = np.stack([owner[e - seq_len:e + 1] for e in ends])
    segments = np.stack([np.unique(f[:-1], return_inverse=True)[1] + 1
                         for f in files]).astype(np.int32)
    logits = np.asarray(apply(params, window[:, :-1], segments), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True))
                           .sum(-1, keepdims=True)) - logits.max(
                               -1, keepdims=True)
    nll = -np.take_along_axis(logp, window[:, 1:, None], -1)[..., 0]
    keep = (np.arange(seq_len) >= seq_len - 16) & (files[:, 1:] ==
                                                    files[:, :-1])
    bits = nll[keep].mean() / np.log(2)
    np.testing.assert_allclose(got[str(seq_len)] / np.log(2), bits,
                               rtol=1e-5)


def test_bits_per_byte_compare_per_seed_with_their_spread():
  import statistics
  from experiments.sweeps import sweep_markdown
  from experiments.sweeps import sweep_report

  def cell(mixer, bits, steps, curves):
    return dict(task="text", seq_len=256, mixer=mixer, bits_by_seed={
        s: {"256": b256, "1024": b1024, "steps": n, "curve": curve}
        for s, (b256, b1024), n, curve in zip(range(3), bits, steps,
                                              curves)})
  # kda converged at 2000 steps in seed 0; gdn went on to 3000 there.
  kda = cell("kda", [(2.0, 1.9), (2.1, 2.0), (2.05, 1.95)],
             [2000, 3000, 3000],
             [([1900, 2000], [2.01, 2.0]), ([2900, 3000], [2.12, 2.1]),
              ([2900, 3000], [2.06, 2.05])])
  gdn = cell("gdn", [(1.95, 1.92), (2.15, 2.04), (2.08, 1.99)],
             [3000, 3000, 3000],
             [([2000, 3000], [2.03, 1.95]), ([2900, 3000], [2.16, 2.15]),
              ([2900, 3000], [2.09, 2.08])])
  out = sweep_report.compare_bits([kda, gdn], ("kda", "gdn"))
  by = {(c["length"], c["equal_steps"]): c for c in out}
  assert sorted(by) == [(256, False), (256, True), (1024, False)]
  final = by[(256, False)]
  want = [2.0 - 1.95, 2.1 - 2.15, 2.05 - 2.08]
  np.testing.assert_allclose(final["differences"], want)
  assert final["mean"] == pytest.approx(statistics.mean(want))
  assert final["sd"] == pytest.approx(statistics.stdev(want))
  assert final["verdict"] == "mixed"
  assert final["steps"] == [[2000, 3000], [3000, 3000], [3000, 3000]]
  # At equal steps seed 0 compares gdn at kda's 2000: 2.0 - 2.03.
  equal = by[(256, True)]
  np.testing.assert_allclose(equal["differences"],
                             [2.0 - 2.03, 2.1 - 2.15, 2.05 - 2.08])
  assert equal["verdict"] == "lower in every seed"
  assert by[(1024, False)]["verdict"] == "lower in every seed"
  lines = sweep_markdown._bits_comparison_lines(out)
  assert lines[-2] == ("| 256 | kda - gdn | 256 (equal steps) | 2000 / 3000"
                       " / 3000 | -0.030 / -0.050 / -0.030 | -0.037 |"
                       " 0.012 | lower in every seed |")


def test_a_text_run_writes_only_under_its_workdir_and_the_caches(tmp_path):
  # As a user runs it, from another folder: every file it writes is under
  # --workdir or the documented caches, ~/.cache/linear_attention/ (the
  # corpus, task.cache_dir's default, and the compilation cache).
  assert text_config.get_config().task.cache_dir == text_lib.CACHE_DIR
  source = _corpus(str(tmp_path / "src"))
  home, cwd, workdir = (tmp_path / d for d in ("home", "cwd", "work"))
  home.mkdir()
  cwd.mkdir()
  # The repository ahead of the caller's path (a TPU host brings its
  # packages by PYTHONPATH).
  path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
  env = {**os.environ, "HOME": str(home), "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": path, "MPLCONFIGDIR": str(tmp_path / "mpl")}
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "run_experiment.py"),
       f"--config={REPO}/configs/text.py:smoke", f"--workdir={workdir}",
       f"--config.task.source_dir={source}"],
      cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert os.listdir(cwd) == []
  assert os.listdir(home) == [".cache"]
  assert os.listdir(home / ".cache") == ["linear_attention"]
  caches = home / ".cache" / "linear_attention"
  assert sorted(os.listdir(caches)) == ["jax_compilation_cache",
                                        "text_corpus"]
  (corpus,) = os.listdir(caches / "text_corpus")
  with open(caches / "text_corpus" / corpus / "corpus.json") as f:
    fingerprint = json.load(f)["fingerprint"]
  with open(workdir / "summary.json") as f:
    assert json.load(f)["corpus"] == fingerprint
  assert corpus == fingerprint["sha256"][:16]
