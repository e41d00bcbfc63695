"""tests/tpu.sh's pieces cover every test file once (the TPU suite misses none)."""

import pathlib
import subprocess

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
