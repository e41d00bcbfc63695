"""tests/tpu.sh: its pieces cover every test file once (the TPU suite misses
none), and a piece cut off mid-run resumes from its ledger."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pieces_cover_every_test_file_once():
  listed = subprocess.run(["bash", str(ROOT / "tests" / "tpu.sh"), "--list"],
                          check=True, capture_output=True, text=True,
                          cwd=ROOT).stdout.split()
  files = []
  for entry in listed:
    path = ROOT / entry
    files += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
  rel = [str(f.relative_to(ROOT)) for f in files]
  assert len(rel) == len(set(rel)), f"a test file in two pieces: {sorted(rel)}"
  every = sorted(str(f.relative_to(ROOT)) for f in ROOT.glob("tests/**/test_*.py"))
  assert sorted(rel) == every, (
      f"not in any piece: {sorted(set(every) - set(rel))}; "
      f"listed but missing: {sorted(set(rel) - set(every))}")


CRASHY = '''
import os, pathlib

def test_passes():
  pass

def test_fails():
  assert False

def test_dies_the_first_time():
  marker = pathlib.Path(__file__).with_name("ran_once")
  if not marker.exists():
    marker.touch()
    os._exit(9)  # the process dies mid-piece, as a chip command cut off
'''


def test_a_cut_piece_resumes_from_its_ledger(tmp_path):
  (tmp_path / "test_crashy.py").write_text(CRASHY)
  ledger = tmp_path / "tpu-ledger-ops_kda.tsv"
  # The repository ahead of the caller's path (a TPU host brings its
  # packages by PYTHONPATH); the child on the CPU (the parent may hold a
  # chip).
  path = os.pathsep.join(filter(None, [str(ROOT),
                                       os.environ.get("PYTHONPATH")]))
  env = dict(os.environ, LINEAR_ATTENTION_TEST_LEDGER=str(ledger),
             PYTHONPATH=path, TPU_JUNIT_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  run = lambda: subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p",
       "no:cacheprovider", "-p", "no:xdist", "-q", "test_crashy.py"],
      cwd=tmp_path, env=env, capture_output=True, text=True)
  first = run()
  assert first.returncode == 9, first.stdout + first.stderr
  outcomes = [line.split("\t")[:2] for line in ledger.read_text().splitlines()]
  assert outcomes == [["passed", "test_crashy.py::test_passes"],
                      ["failed", "test_crashy.py::test_fails"]]
  second = run()  # runs only the test the crash cut off
  assert "1 passed, 2 deselected" in second.stdout, second.stdout
  assert len(ledger.read_text().splitlines()) == 3
  summary = subprocess.run(["bash", str(ROOT / "tests" / "tpu.sh"),
                            "--summary"], env=env, cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout
  assert "ops_kda: 3 tests, 2 passed, 1 failed, 0 skipped" in summary, summary
  assert "ops_csa: not run" in summary
