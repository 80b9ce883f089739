"""Checks the runnable commands quoted in README.md and docs/*.md.

Convention: a fenced code block whose info string contains the word `runnable`
(```` ```bash runnable ````) holds commands a reader is told to run from the repository root.
For every such command this script checks, without running anything, that
- `nox -s A B` / `nox --session A` names sessions that exist (--sessions lists them),
- every path-like argument (contains a `/` or ends in .py/.sh/.md/.toml/.ini) exists,
- `cd DIR` names an existing directory.
Blocks without the marker are illustrations and are not checked. A repository whose docs
contain no runnable block at all fails: the check would otherwise be vacuous.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
PATH_SUFFIXES = (".py", ".sh", ".md", ".toml", ".ini", ".txt", ".json")


def runnable_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each command line inside runnable fences of `path`."""
    commands: list[tuple[int, str]] = []
    fence: str | None = None
    runnable = False
    pending = ""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if m and fence is None:
            fence, runnable = m.group(2), "runnable" in m.group(3).split()
            continue
        if m and fence is not None and m.group(2).startswith(fence) and not m.group(3).strip():
            fence, runnable = None, False
            continue
        if fence is None or not runnable:
            continue
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        commands.append((number, pending + text))
        pending = ""
    return commands


def _looks_like_path(token: str) -> bool:
    if token.startswith("-") or any(c in token for c in "$*=<>{}") or "://" in token:
        return False
    return "/" in token or token.endswith(PATH_SUFFIXES)


def check_command(command: str, sessions: set[str]) -> list[str]:
    problems = []
    for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", command):
        try:
            tokens = shlex.split(part)
        except ValueError as exc:
            return [f"cannot parse: {exc}"]
        while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
            tokens.pop(0)  # leading VAR=value assignments
        if not tokens:
            continue
        if tokens[0] == "nox":
            problems += _check_nox(tokens[1:], sessions)
        if tokens[0] == "cd" and len(tokens) > 1 and not (ROOT / tokens[1]).is_dir():
            problems.append(f"cd {tokens[1]}: no such directory")
            continue
        for token in tokens[1:]:
            if tokens[0] == "nox":
                break  # nox arguments after -- are passed through to the session
            if _looks_like_path(token) and not (ROOT / token).exists():
                problems.append(f"{token}: no such file or directory")
    return problems


def _check_nox(args: list[str], sessions: set[str]) -> list[str]:
    problems = []
    named: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg in ("-s", "--session", "--sessions", "-e"):
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                named.append(args[i])
                i += 1
            continue
        i += 1
    for name in named:
        base = name.split("(")[0].split("-")[0] if name not in sessions else name
        if base not in sessions:
            problems.append(f"nox session {name!r} does not exist (known: {sorted(sessions)})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", nargs="+", required=True, help="existing nox sessions")
    args = parser.parse_args()
    sessions = set(args.sessions)

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    total = 0
    failures = 0
    for path in files:
        if not path.exists():
            continue
        for number, command in runnable_commands(path):
            total += 1
            for problem in check_command(command, sessions):
                failures += 1
                print(f"{path.relative_to(ROOT)}:{number}: `{command}`: {problem}", file=sys.stderr)
    if total == 0:
        print("no runnable code blocks found in README.md or docs/*.md", file=sys.stderr)
        return 1
    print(f"checked {total} runnable commands in {len(files)} files: {failures} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
