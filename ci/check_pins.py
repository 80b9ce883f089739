"""Checks that the version pins between the spyreccl packages agree.

- spyreccl-torch pins `torch==<minor>.*` (in [project].dependencies and [build-system].requires)
  and that minor must be the one the nox `tests` session installs (passed as --torch).
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
    parser.add_argument("--torch", required=True, help="torch minor the tests install, e.g. 2.13")
    args = parser.parse_args()

    problems: list[str] = []
    good: list[str] = []
    torch_toml = tomllib.loads((TORCH_PKG / "pyproject.toml").read_text())
    sections = {
        "[project].dependencies": torch_toml.get("project", {}).get("dependencies", []),
        "[build-system].requires": torch_toml.get("build-system", {}).get("requires", []),
    }

    want_torch = f"=={args.torch}.*"
    for where, reqs in sections.items():
        pins = pins_of(reqs, "torch")
        if pins != [want_torch]:
            problems.append(
                f"spyreccl-torch {where}: torch pin is {pins or 'missing'}, expected "
                f"['{want_torch}'] (the torch minor the nox tests session installs)"
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
