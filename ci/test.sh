#!/usr/bin/env bash
# The test job, through nox: lint, the full test suite on the torch minor whose CPU wheel is
# on the machine (TORCH_PINNED), the version-pin and docs checks, the emulated device in its
# discrete memory mode (tests_discrete), then the torch matrix: a build and
# the smoke subset on every other supported torch minor (CUDA wheels from PyPI).
#   bash ci/test.sh                 everything CI runs
#   bash ci/test.sh -- -x -k ddp    extra arguments after `--` go to pytest in the tests session
#   SPYRECCL_CI_SMOKE="2.10 2.15"   the matrix minors to smoke-test, in order (default: all
#                                   five, "2.10 2.15 2.14 2.12 2.11"; "" for none)
# Exit status: non-zero when any nox session failed (a pytest run that collects no test fails).
# A smoke session that the disk or the time budget cannot take is skipped and says why.
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

LOG=$(mktemp "${TMPDIR:-/tmp}/spyreccl-ci-test.XXXXXX.log")
trap 'rm -f "$LOG"' EXIT

# CI kills the job at 90 minutes; stop a few minutes earlier so the summary is still printed.
BUDGET_MIN=${SPYRECCL_CI_MINUTES:-85}
DEADLINE=$(($(date +%s) + BUDGET_MIN * 60))
# The venvs of the other torch minors (~7 GB each) live outside the checkout, so that every
# later run, in any clone, reuses them instead of downloading torch again.
MATRIX_ENVDIR=${SPYRECCL_MATRIX_ENVDIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spyreccl-ci/nox}
# By default every supported minor but 2.13 (which the full suite runs): 2.10 (torch-spyre's)
# first, then the newest down. With its venv present and the compiler cache warm a smoke run
# takes about 3 minutes on 2 quiet cores; a whole run with all five took 30 minutes
# (docs/development.md, Torch versions). A minor whose build would be cold is skipped when
# the budget cannot take it (noxfile.py, _smoke_affordable), and the run says so.
# SPYRECCL_CI_SMOKE runs any set.
ALL_SMOKE_MINORS="2.10 2.15 2.14 2.12 2.11"
SMOKE_MINORS=${SPYRECCL_CI_SMOKE-$ALL_SMOKE_MINORS}

_nox() {
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -le 60 ]; then
    echo "ci: SKIPPED nox $*: the ${BUDGET_MIN}-minute budget is spent" | tee -a "$LOG" >&2
    return 1
  fi
  timeout --kill-after=60 "$left" \
    "$NOX" --non-interactive --no-color -f "$ROOT/noxfile.py" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then
    echo "ci: nox $* was stopped at the end of the ${BUDGET_MIN}-minute budget" | tee -a "$LOG" >&2
  fi
  return "$rc"
}

set +e
_nox -s lint tests pins docs tests_discrete "$@"
status=$?
for minor in $ALL_SMOKE_MINORS; do
  case " $SMOKE_MINORS " in
    *" $minor "*) ;;
    *) echo "ci: SKIPPED smoke(torch='$minor'): not in this run's minors \"$SMOKE_MINORS\" (SPYRECCL_CI_SMOKE)" | tee -a "$LOG" ;;
  esac
done
if [ -n "$SMOKE_MINORS" ]; then
  sessions=()
  for minor in $SMOKE_MINORS; do sessions+=("smoke(torch='$minor')"); done
  SPYRECCL_CI_DEADLINE=$DEADLINE _nox --envdir "$MATRIX_ENVDIR" -s "${sessions[@]}"
  smoke_status=$?
  [ "$status" -eq 0 ] && status=$smoke_status
fi
set -e

"$CI_VENV/bin/python" "$ROOT/ci/summarize.py" "$LOG"
exit "$status"
