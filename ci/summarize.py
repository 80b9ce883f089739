"""Prints the test summary of a CI log: every pytest and ctest closing line, the nox session
results, and one total line `total: N passed, N failed, N skipped` (errors count as failed)."""

from __future__ import annotations

import re
import sys

_OUTCOMES = r"(?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|no tests ran)"
PYTEST_LINE = re.compile(rf"^=+ (.*\b{_OUTCOMES}\b.*) in [0-9.]+s.*=+$")
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
# "100% tests passed out of 32" (recent CMake) or "90% tests passed, 1 tests failed out of 10"
CTEST_LINE = re.compile(r"^\d+% tests passed(?:, (\d+) tests? failed)? out of (\d+)")
NOX_RESULT = re.compile(r"^nox > \* (.+)$")


def main(path: str) -> None:
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    pytest_lines, ctest_lines, sessions = [], [], []
    with open(path, errors="replace") as log:
        for raw in log:
            line = raw.rstrip("\n")
            if m := PYTEST_LINE.match(line):
                pytest_lines.append(m.group(1))
                for count, kind in PYTEST_COUNT.findall(m.group(1)):
                    key = {
                        "error": "failed",
                        "errors": "failed",
                        "xfailed": "passed",
                        "xpassed": "failed",
                    }.get(kind, kind)
                    totals[key] += int(count)
            elif m := CTEST_LINE.match(line):
                ctest_lines.append(line)
                failed, total = int(m.group(1) or 0), int(m.group(2))
                totals["passed"] += total - failed
                totals["failed"] += failed
            elif m := NOX_RESULT.match(line):
                sessions.append(m.group(1))
    print("=" * 30 + " CI summary " + "=" * 30)
    for line in pytest_lines:
        print(f"pytest: {line}")
    for line in ctest_lines:
        print(f"ctest: {line}")
    for line in sessions:
        print(f"nox session {line}")
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )


if __name__ == "__main__":
    main(sys.argv[1])
