#!/usr/bin/env bash
# The suite on a TPU host, in pieces meant to run in under 10 minutes each on
# one TPU v5e chip (their times are recorded in docs/tpu.md once measured):
#   tests/tpu.sh [PIECE ...]     (no PIECE: every piece in turn)
#   tests/tpu.sh --list          (the test paths of all pieces)
#   tests/tpu.sh --summary       (each piece's counts from its ledger)
# One process holds the chip, so pytest runs without xdist. Compiled programs
# are cached on disk between pieces; each run of a piece writes its own
# JUnit file, tpu-tests-<piece>-<UTC time>.xml. Each piece also keeps a
# ledger, tpu-ledger-<piece>.tsv (outcome, test, seconds; a line as each
# test finishes): a piece cut by a time limit or a crash resumes where it
# stopped when run again (the tests in its ledger are not run twice), and
# its exit status counts every failure in the ledger, not only this run's;
# delete the ledger to run a piece from the start.
# Environment: PYTHON (default .venv/bin/python), TPU_JUNIT_DIR (default .),
# JAX_COMPILATION_CACHE_DIR (default ~/.cache/linear_attention/...).
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
junit_dir="${TPU_JUNIT_DIR:-.}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-tpu,cpu}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/linear_attention/jax_compilation_cache}"

paths() {
  case "$1" in
    ops_kda) echo tests/ops/test_kda.py tests/ops/test_kda_precision.py \
      tests/ops/test_kda_pallas.py ;;
    # ops_more ran 56 tests in 605 s on a v5e (dc64d6d): split where its
    # float64 tests (chunk states, gradient anchors; now on the host CPU,
    # `testing.float64_on_host`) took minutes there.
    ops_states) echo tests/ops/test_kda_chunk_states.py \
      tests/ops/test_kda_chunked_naive.py tests/ops/test_kda_device_accuracy.py \
      tests/ops/test_kda_export.py tests/ops/test_kda_gates.py \
      tests/ops/test_kda_linalg.py tests/ops/test_backends.py ;;
    ops_anchors) echo tests/ops/test_gradient_anchors.py ;;
    # ops_pallas ran 73 of its then 133 tests in 279 s on a v5e (e3a765f),
    # all of test_kda_pallas_batched.py's first: split by file.
    ops_pallas) echo tests/ops/test_kda_pallas_batched.py ;;
    ops_pallas_backend) echo tests/ops/test_kda_pallas_backend.py ;;
    ops_random) echo tests/ops/test_kda_randomized.py \
      tests/ops/test_kda_regressions.py tests/ops/test_kda_bad_values.py ;;
    ops_csa) echo tests/ops/test_csa.py tests/ops/test_short_conv.py \
      tests/modules/test_csa_indexer.py tests/modules/test_short_conv.py ;;
    # modules ran 438 of its 440 tests in 416 s on a v5e (e3a765f): the
    # layers (208 s) apart from the top-level tests (the benchmarks' smoke
    # runs, the precision and architecture checks).
    modules) echo tests/modules/test_kda.py tests/modules/test_attention.py ;;
    top) echo tests/test_*.py ;;
    parallel) echo tests/parallel ;;
    experiments_a) echo tests/experiments/test_export_tpu.py \
      tests/experiments/test_faults.py tests/experiments/test_generation.py \
      tests/experiments/test_model.py tests/experiments/test_multiprocess.py \
      tests/experiments/test_recall.py tests/experiments/test_compilation_cache.py \
      tests/experiments/test_distributed.py tests/experiments/test_mixers.py ;;
    experiments_b) echo tests/experiments/test_run.py \
      tests/experiments/test_run_lock.py tests/experiments/test_schedules.py \
      tests/experiments/test_tasks.py tests/experiments/test_text.py \
      tests/experiments/test_bad_input_cli.py ;;
    experiments_sweep) echo tests/experiments/test_sweep.py ;;
    *) return 1 ;;
  esac
}
ALL="ops_kda ops_states ops_anchors ops_pallas ops_pallas_backend ops_random ops_csa modules top parallel experiments_a experiments_b experiments_sweep"

if [ "${1:-}" = "--list" ]; then  # every piece's test files, one a line
  for piece in $ALL; do paths "$piece"; done | tr ' ' '\n'
  exit 0
fi

summary() {  # counts of one piece's ledger
  local ledger="$junit_dir/tpu-ledger-$1.tsv"
  [ -f "$ledger" ] || { echo "$1: not run"; return; }
  # The last line of a test is its outcome (a resumed run never repeats it).
  awk -F'\t' -v piece="$1" '{ o[$2] = $1; s[$2] = $3 }
    END { for (t in o) { n[o[t]]++; total++; secs += s[t] }
          printf "%s: %d tests, %d passed, %d failed, %d skipped, %.0f s\n",
                 piece, total, n["passed"], n["failed"], n["skipped"], secs }' \
    "$ledger"
}

if [ "${1:-}" = "--summary" ]; then
  for piece in $ALL; do summary "$piece"; done
  exit 0
fi

status=0
for piece in ${*:-$ALL}; do
  if ! files=$(paths "$piece"); then
    echo "tests/tpu.sh: unknown piece '$piece'; pieces: $ALL" >&2
    exit 2
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  LINEAR_ATTENTION_TEST_LEDGER="$junit_dir/tpu-ledger-$piece.tsv" \
    "$python" -m pytest -p no:xdist -q -rs --durations=10 \
    --junitxml="$junit_dir/tpu-tests-$piece-$(date -u +%Y%m%dT%H%M%S).xml" \
    $files
  rc=$?
  counts=$(summary "$piece")
  # 1 (a failure) and 5 (every test already in the ledger) stand for the
  # ledger's outcome: a failure in an earlier run of the piece counts too.
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ] || [ "$rc" -eq 5 ]; then
    case "$counts" in *", 0 failed,"*|*": not run") rc=0 ;; *) rc=1 ;; esac
  fi
  echo "tests/tpu.sh: piece $piece exit $rc in $(( $(date +%s) - start )) s"
  echo "$counts"
  [ "$rc" -eq 0 ] || status=$rc
done
exit $status
