#!/usr/bin/env bash
# The test job: lint, the full test suite, the version-pin check and the docs check, through nox.
#   bash ci/test.sh                 everything CI runs
#   bash ci/test.sh -- -x -k ddp    extra arguments after `--` go to pytest in the tests session
# Exit status: non-zero when any nox session failed (a pytest run that collects no test fails).
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

LOG=$(mktemp "${TMPDIR:-/tmp}/spyreccl-ci-test.XXXXXX.log")
trap 'rm -f "$LOG"' EXIT

# CI kills the job at 90 minutes; stop a few minutes earlier so the summary is still printed.
set +e
timeout --kill-after=60 "${SPYRECCL_CI_TIMEOUT:-85m}" \
  "$NOX" --non-interactive --no-color -f "$ROOT/noxfile.py" -s lint tests pins docs tests_discrete "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -eq 124 ]; then
  echo "ci: nox was stopped after ${SPYRECCL_CI_TIMEOUT:-85m}" >&2
fi

"$CI_VENV/bin/python" "$ROOT/ci/summarize.py" "$LOG"
exit "$status"
