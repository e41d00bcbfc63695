#!/usr/bin/env bash
# Rewrites lock.txt and lock-tpu.txt from a throwaway venv: the project's
# ranges (setup.py, with the test extra) resolved with jax and jaxlib pinned
# to $JAX, and the libtpu that JAX's `tpu` extra pins, at its newest release
# on the registry. Run from the repository root: `make lock [JAX=0.12.0.1]`.
set -euo pipefail
jax_version="${JAX:-0.12.0.1}"
python="${PYTHON:-python3.12}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
pip="$tmp/venv/bin/python -m pip"
$pip install --quiet --upgrade pip
$pip install --quiet "jax==$jax_version" "jaxlib==$jax_version" -e '.[test]'
{
  echo "# The tested environment: exact versions for Python 3.12 on Linux x86_64."
  echo "# \`make test\` and \`make experiment\` install from this file, then the project"
  echo "# itself with --no-deps; setup.py keeps the ranges for library users."
  echo "# Refresh: \`make lock\` (JAX=$jax_version by default; see the Makefile)."
  $pip freeze --exclude-editable
} > requirements/lock.txt
# The requirement JAX's tpu extra states, e.g. "libtpu==0.0.50.*".
spec=$("$tmp/venv/bin/python" -c "
import importlib.metadata as m
print([r.split(';')[0].strip() for r in m.requires('jax') if r.startswith('libtpu')][0])")
$pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_31_x86_64 -d "$tmp/wheel" "$spec"
wheel=$(basename "$tmp"/wheel/libtpu-*.whl)
version=$(echo "$wheel" | cut -d- -f2)
{
  echo "# lock.txt plus JAX's TPU runtime: the libtpu that jax $jax_version's \`tpu\` extra"
  echo "# pins ($spec), at its newest release on the registry."
  echo "# Refresh: \`make lock\`."
  echo "-r lock.txt"
  echo "libtpu==$version"
} > requirements/lock-tpu.txt
echo "lock.txt: $(grep -c '==' requirements/lock.txt) packages; lock-tpu.txt: libtpu==$version"
