"""Checks the docs: runnable commands in README.md and docs/, and words the project does not use.

Convention: a fenced code block whose info string contains the word `runnable`
(```` ```bash runnable ````) holds commands a reader is told to run from the repository root.
For every such command this script checks, without running anything, that
- `nox -s A B` / `nox --session A` names sessions that exist (--sessions lists them),
- every path-like argument (contains a `/` or ends in .py/.sh/.md/.toml/.ini) exists,
- `cd DIR` names an existing directory.
Blocks without the marker are illustrations and are not checked. A repository whose docs
contain no runnable block at all fails: the check would otherwise be vacuous.

It also flags, in README.md, docs/**/*.md and CHANGELOG.md, words by which the project would
speak of its tracker and its working conditions instead of itself: tracker issue numbers
("#14", "issue 12"), work sessions ("session 14", "this session"), machines described by how
they were obtained ("the lent machine", "the lease") and "the VM" (name a machine by what it
is: cores, CPU model, memory bandwidth). Code is exempt: fenced blocks, `inline code` and link
targets, so a quoted log line such as "message #4" stays as it is. A line that must keep such a
word anyway ends with the comment <!-- check-docs: allow -->.
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
ALLOW_MARKER = "<!-- check-docs: allow -->"

# (pattern, what it is); matched against prose with code spans and link targets removed.
FORBIDDEN_WORDS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?<![\w/&#])#\d+\b"), "a tracker issue number"),
    (
        re.compile(r"\b(?:issues?|PR|pull request)\s+#?\d+\b", re.IGNORECASE),
        "a tracker issue number",
    ),
    (re.compile(r"\bsessions?\s+\d+\b", re.IGNORECASE), "a work session"),
    (
        re.compile(
            r"\b(?:this|that|the same|the previous|the next|an earlier|a later)\s+session\b",
            re.IGNORECASE,
        ),
        "a work session",
    ),
    (
        re.compile(
            r"\blent\b(?:\s+[\w-]+){0,4}?\s+(?:machines?|VMs?|servers?)\b"
            r"|\b(?:machines?|VMs?|servers?)\s+(?:(?:was|were|that was|that were)\s+)?lent\b"
            r"|\b(?:the|a|its|this|that)\s+lease\b",
            re.IGNORECASE,
        ),
        "a machine described by how it was obtained (say what it is: cores, CPU model, memory)",
    ),
    (
        re.compile(r"\b(?:the|this|that|our)\s+(?:[\w-]+\s+){0,3}?VM(?:'s|s)?\b", re.IGNORECASE),
        '"the VM" (say what the machine is: cores, CPU model, memory bandwidth)',
    ),
]
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


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


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) for each line of `path` outside fenced blocks, with inline code
    spans and link targets blanked out and lines carrying ALLOW_MARKER dropped."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(2)
            continue
        if m and fence is not None and m.group(2).startswith(fence) and not m.group(3).strip():
            fence = None
            continue
        if fence is not None:
            continue
        text = _blank_code(line)
        if ALLOW_MARKER not in text:  # the marker itself, not a mention of it in code
            lines.append((number, text))
    return lines


def _blank_code(line: str) -> str:
    """`line` with inline code spans blanked and link targets emptied (columns kept)."""
    return LINK_TARGET.sub("]()", CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line))


def forbidden_words(text: str) -> list[tuple[str, str]]:
    """(the words found, what they are) for every forbidden word in one line of prose."""
    return [(m.group(0), what) for pattern, what in FORBIDDEN_WORDS for m in pattern.finditer(text)]


# The check checks itself first: a pattern that stopped matching would pass every doc.
_MUST_FLAG = (
    "fixed in issue #15",
    "see #14 for the rest",
    "the target of issue 12",
    "measured in session 14",
    "as this session found",
    "on the lent 16-core Intel Xeon machine",
    "the lease was spent",
    "in the VM's fast phase",
    "on the 2-CPU development VM",
)
_MUST_PASS = (
    "allreduce seq 12 on 4 ranks",
    "the nox session `docs` and the tests session",
    "the session's pool for this world size",
    "a host tensor lent to a CPU kernel",
    "spyre tensors lent to the host's CPU kernels",
    "a 2-vCPU AMD EPYC virtual machine",
    "(performance.md#2-rank-sweep)",
    "[the sweep](performance.md#2-rank-sweep)",
    "`message #4` in a quoted log",
    "C# and F#, &#8212;",
)


def _self_check() -> None:
    for text in _MUST_FLAG:
        if not forbidden_words(text):
            raise SystemExit(f"check_docs: the word patterns no longer flag {text!r}")
    for text in _MUST_PASS:
        found = forbidden_words(_blank_code(text))
        if found:
            raise SystemExit(f"check_docs: the word patterns flag {text!r}: {found}")


def word_files() -> list[Path]:
    """The docs whose prose is checked for forbidden words."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


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
    _self_check()

    failures = 0
    checked_words = 0
    for path in word_files():
        if not path.exists():
            continue
        checked_words += 1
        for number, text in prose_lines(path):
            for words, what in forbidden_words(text):
                failures += 1
                print(
                    f"{path.relative_to(ROOT)}:{number}: {words!r}: {what}; the project "
                    "speaks of itself only",
                    file=sys.stderr,
                )

    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    total = 0
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
    print(
        f"checked {total} runnable commands in {len(files)} files and the words of "
        f"{checked_words} files: {failures} problems"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
