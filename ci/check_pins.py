"""Checks that the version pins between the spyreccl packages agree.

- spyreccl-torch declares the torch range it supports, `torch>=<first>,<<next after last>`
  (in [project].dependencies and [build-system].requires), and that range must be exactly the
  torch minors the nox matrix builds and tests (TORCH_MINORS, passed as --torch-minors): no
  minor declared that CI never builds, none built that pip would refuse to install.
- spyreccl-torch pins `spyreccl-core==X`, and X must equal spyreccl-core's version, which must
  itself agree with the C header (SPYRECCL_MAJOR/MINOR/PATCH) and CMake's project() version.

Exit status 1 with one line per disagreement; 0 with one line per agreement.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "packages" / "spyreccl-core"
TORCH_PKG = ROOT / "packages" / "spyreccl-torch"

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins_of(requirements: list[str], name: str) -> list[str]:
    """Version specifiers of every requirement on `name` (e.g. ['==2.13.*'])."""
    found = []
    for req in requirements:
        m = _REQ.match(req)
        if m and _normalize(m.group(1)) == _normalize(name):
            found.append(m.group(3).replace(" ", ""))
    return found


def torch_range(minors: list[str]) -> tuple[str, str | None]:
    """The requirement that covers exactly `minors` (consecutive minors of one major, oldest
    first), and a problem when they are not that."""
    parsed = []
    for minor in minors:
        m = re.fullmatch(r"(\d+)\.(\d+)", minor)
        if not m:
            return "", f"torch matrix: '{minor}' is not a torch minor like 2.10"
        parsed.append((int(m.group(1)), int(m.group(2))))
    major = parsed[0][0]
    expected = [(major, parsed[0][1] + i) for i in range(len(parsed))]
    if parsed != expected:
        return "", (
            f"torch matrix: {' '.join(minors)} are not consecutive minors of one major, oldest "
            "first; a gap would be declared supported and never tested"
        )
    return f">={minors[0]},<{major}.{parsed[-1][1] + 1}", None


def core_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    project = tomllib.loads((CORE / "pyproject.toml").read_text())["project"]
    if "version" in project:
        versions["packages/spyreccl-core/pyproject.toml"] = project["version"]
    header = (CORE / "include" / "spyreccl" / "spyreccl.h").read_text()
    parts = [
        re.search(rf"#define\s+SPYRECCL_{p}\s+(\d+)", header) for p in ("MAJOR", "MINOR", "PATCH")
    ]
    if all(parts):
        versions["spyreccl.h SPYRECCL_MAJOR/MINOR/PATCH"] = ".".join(m.group(1) for m in parts)
    cmake = CORE / "CMakeLists.txt"
    if cmake.exists():
        m = re.search(r"project\(\s*spyreccl\b[^)]*\bVERSION\s+([0-9.]+)", cmake.read_text())
        if m:
            versions["packages/spyreccl-core/CMakeLists.txt project()"] = m.group(1)
    return versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--torch-minors",
        nargs="+",
        required=True,
        help="the torch minors of the nox matrix, oldest first, e.g. 2.10 2.11 2.12",
    )
    args = parser.parse_args()

    problems: list[str] = []
    good: list[str] = []
    torch_toml = tomllib.loads((TORCH_PKG / "pyproject.toml").read_text())
    sections = {
        "[project].dependencies": torch_toml.get("project", {}).get("dependencies", []),
        "[build-system].requires": torch_toml.get("build-system", {}).get("requires", []),
    }

    want_torch, matrix_problem = torch_range(args.torch_minors)
    if matrix_problem:
        problems.append(matrix_problem)
    for where, reqs in sections.items() if not matrix_problem else ():
        pins = pins_of(reqs, "torch")
        if pins != [want_torch]:
            problems.append(
                f"spyreccl-torch {where}: torch requirement is {pins or 'missing'}, expected "
                f"['{want_torch}'] (the torch minors the nox matrix tests: "
                f"{' '.join(args.torch_minors)})"
            )
        else:
            good.append(f"spyreccl-torch {where}: torch{want_torch}")

    versions = core_versions()
    if "packages/spyreccl-core/pyproject.toml" not in versions:
        problems.append("spyreccl-core: [project].version is missing from pyproject.toml")
    distinct = set(versions.values())
    if len(distinct) > 1:
        problems.append(
            "spyreccl-core: its version sources disagree: "
            + ", ".join(f"{k} = {v}" for k, v in versions.items())
        )
    core_version = versions.get("packages/spyreccl-core/pyproject.toml")
    if core_version:
        for where, reqs in sections.items():
            pins = pins_of(reqs, "spyreccl-core")
            if pins != [f"=={core_version}"]:
                problems.append(
                    f"spyreccl-torch {where}: spyreccl-core pin is {pins or 'missing'}, expected "
                    f"['=={core_version}'] (spyreccl-core's version)"
                )
            else:
                good.append(f"spyreccl-torch {where}: spyreccl-core=={core_version}")
        if len(distinct) == 1:
            good.append(f"spyreccl-core version {core_version} agrees in: {', '.join(versions)}")

    for line in good:
        print(f"ok: {line}")
    for line in problems:
        print(f"MISMATCH: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
