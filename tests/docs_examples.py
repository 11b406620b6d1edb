"""The shell examples of the project's Markdown pages, run as a user runs them: the ```console blocks.

A block holds commands (`$ ` lines; a command ending in `\\` goes on in the next line, which starts with `> `)
each followed by the lines it prints and, when it does not exit 0, a last line `[exit N]`. A ```python block
runs too, as a script that must exit 0, in its place among the page's blocks (so a console block can read
what it wrote); pages whose Python examples another test runs are named in PYTHON_RUN_ELSEWHERE. A line `...` stands
for any number of lines (none included), and `...` inside a line for any text. Timings (`0.12 s`, `3.68s`) are
compared as numbers of seconds, whatever their value, and the scratch directory's path is shown as `.`.

Each command runs in bash on a pseudo-terminal of WIDTH x HEIGHT, as in a user's terminal (what a command
prints differs between a terminal and a pipe), with the checkout's `dcptool` first on PATH and stdout and
stderr interleaved as a terminal shows them; a terminal emulator (pyte) turns what it writes into the lines
a user sees (progress bars drawn and erased). A line longer than the terminal is shown whole, as a terminal
gives it back when copied (it only wraps it on the screen); what the program wraps itself to the width stays
wrapped. The blocks of one page run in order in one scratch directory holding a copy of samples/, so a page
can write a file and read it later.
"""

from __future__ import annotations

import difflib
import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 100, 40  # the terminal the examples are shown on
SCREEN_COLUMNS = 4096  # the emulator's lines: a longer line than WIDTH is one line, as a terminal copies it
SCREEN_LINES = 3000  # what the emulator keeps: an example that prints more fails (show less with --max-findings)
TIMEOUT = 120.0  # seconds a command may take
EXIT = re.compile(r"\[exit (\d+)\]")
ELLIPSIS = "..."
# a duration: compared as "a number of seconds", whatever the number (3.68s, 0.12 s, 1.2 ms)
TIMING = re.compile(r"\b\d+(?:\.\d+)?( ?)(s|ms|µs)\b")
# environment that would make a run differ from a user's: our own switches, a caller's terminal settings
SCRUB = ("DCPTOOL_", "PYTEST_", "TRITON_", "TTY_", "CLICOLOR")
SCRUB_KEYS = {"COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "PYTHONWARNINGS", "CI"}


@dataclass
class Command:
    line: int  # of the `$ ` line in its page, 1-based
    text: str
    expected: list[str] = field(default_factory=list)
    exit: int = 0


@dataclass
class Block:
    path: Path
    line: int  # of its opening fence, 1-based
    commands: list[Command]  # a console block's
    python: str | None = None  # a python block's source


# pages whose ```python examples another test runs as they need (each in its own directory)
PYTHON_RUN_ELSEWHERE = {"docs/format.md": "tests/test_cli.py::test_docs_format_examples_write_dumps_replay_reads"}


def pages() -> list[Path]:
    """Every Markdown page of the repository a user reads."""
    return [ROOT / "README.md", ROOT / "samples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tokens(path: Path) -> list:
    return MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))


def parse_console(content: str, first_line: int, where: str) -> list[Command]:
    """The commands of one console block; first_line is the page's line of its first content line."""
    lines = content.splitlines()
    cmds: list[Command] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("$ "):
            cmd = Command(first_line + i, ln[2:])
            while cmd.text.endswith("\\") and i + 1 < len(lines) and lines[i + 1].startswith("> "):
                i += 1
                cmd.text += "\n" + lines[i][2:]
            cmds.append(cmd)
        elif not cmds:
            raise ValueError(f"{where}:{first_line + i}: output before the block's first `$ ` command")
        elif EXIT.fullmatch(ln):
            if i + 1 < len(lines) and not lines[i + 1].startswith("$ "):
                raise ValueError(f"{where}:{first_line + i}: `{ln}` must be the last line of a command's output")
            cmds[-1].exit = int(EXIT.fullmatch(ln)[1])
        else:
            cmds[-1].expected.append(ln.rstrip())
        i += 1
    return cmds


def console_blocks(path: Path) -> list[Block]:
    return [b for b in examples(path) if b.python is None]


def examples(path: Path) -> list[Block]:
    """A page's console and python blocks, in order."""
    where = path.relative_to(ROOT).as_posix()
    out = []
    for t in tokens(path):
        lang = t.info.split()[:1] if t.type == "fence" else []
        if lang == ["console"]:
            out.append(Block(path, t.map[0] + 1, parse_console(t.content, t.map[0] + 2, where)))
        elif lang == ["python"] and where not in PYTHON_RUN_ELSEWHERE:
            out.append(Block(path, t.map[0] + 1, [], python=t.content))
    return out


# ---- running


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB) and k not in SCRUB_KEYS}
    bindir = Path(sys.executable).parent  # this checkout's venv: its dcptool, python and pytest
    if not (bindir / "dcptool").exists() and shutil.which("dcptool"):
        bindir = Path(shutil.which("dcptool")).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["TERM"] = "xterm-256color"
    return env


def screen_text(data: bytes) -> list[str]:
    """The lines a terminal shows after `data` (long lines whole), trailing blanks dropped."""
    import pyte  # a test dependency (pip install -e '.[test]'); imported here so the other page checks run without it

    screen = pyte.Screen(SCREEN_COLUMNS, SCREEN_LINES)
    pyte.Stream(screen).feed(data.decode("utf-8", "replace"))
    if screen.cursor.y >= SCREEN_LINES - 1:
        raise AssertionError(f"prints more than {SCREEN_LINES} lines: too long for an example")
    lines = []
    for y in range(screen.cursor.y + 1):  # the screen's lines are sparse: read only the cells written
        row = screen.buffer[y]
        lines.append("".join(row[x].data for x in range(max(row, default=-1) + 1)).rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_in_terminal(command: str, cwd: Path, env: dict[str, str], timeout: float = TIMEOUT) -> tuple[int, list[str]]:
    """Run `command` with bash on a new pseudo-terminal; its exit code and the lines the terminal shows."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", HEIGHT, WIDTH, 0, 0))
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([master], [], [], max(left, 0))
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"`{command}` ran past {timeout:.0f} s")
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every end of the terminal's other side is closed
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        os.close(master)
    return rc, screen_text(b"".join(chunks))


# ---- comparing


def _timings(s: str) -> str:
    return TIMING.sub(lambda m: f"<seconds>{m[1]}s" if m[2] == "s" else f"<seconds>{m[1]}{m[2]}", s)


def _pattern(expected: str) -> re.Pattern | None:
    """None for a line `...` (any lines); else the line, `...` inside it standing for any text."""
    if expected.strip() == ELLIPSIS:
        return None
    return re.compile(".*".join(re.escape(part) for part in _timings(expected).split(ELLIPSIS)))


def lines_match(expected: list[str], actual: list[str]) -> bool:
    """Glob matching over lines: a `...` line matches any run of lines (greedy, with backtracking)."""
    pats = [_pattern(e) for e in expected]
    got = [_timings(a) for a in actual]
    p = i = 0
    star, mark = -1, 0
    while i < len(got):
        if p < len(pats) and pats[p] is not None and pats[p].fullmatch(got[i]):
            p, i = p + 1, i + 1
        elif p < len(pats) and pats[p] is None:
            star, mark, p = p, i, p + 1
        elif star >= 0:
            mark += 1
            p, i = star + 1, mark
        else:
            return False
    while p < len(pats) and pats[p] is None:
        p += 1
    return p == len(pats)


def check_command(cmd: Command, where: str, cwd: Path, env: dict[str, str]) -> str | None:
    """None when the command exits and prints as shown, else what differs."""
    rc, actual = run_in_terminal(cmd.text, cwd, env)
    actual = [ln.replace(str(cwd), ".") for ln in actual]
    if rc == cmd.exit and lines_match(cmd.expected, actual):
        return None
    head = f"{where}:{cmd.line}: $ {cmd.text}\n  exit {rc}" + ("" if rc == cmd.exit else f", shown [exit {cmd.exit}]")
    diff = "\n".join(difflib.unified_diff(cmd.expected, actual, "shown", "printed", lineterm="", n=2))
    return f"{head}\n{diff}\n--- printed in full:\n" + "\n".join(actual)


def check_python(block: Block, where: str, cwd: Path, env: dict[str, str]) -> str | None:
    """None when a python block runs to exit 0 in cwd, else what it printed."""
    script = cwd.parent / f"example-{block.line}.py"  # beside the scratch directory, not in it
    script.write_text(block.python, encoding="utf-8")
    p = subprocess.run(["python", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if p.returncode == 0:
        return None
    return f"{where}:{block.line}: the python example exits {p.returncode}:\n{p.stdout}{p.stderr}"


def run_page(path: Path, scratch: Path) -> list[str]:
    """Run every example of a page in order, in scratch (given a copy of samples/); what failed."""
    shutil.copytree(ROOT / "samples", scratch / "samples", ignore=shutil.ignore_patterns("__pycache__"))
    env = user_env()
    where = path.relative_to(ROOT).as_posix()
    failures = []
    for block in examples(path):
        if block.python is not None:
            msg = check_python(block, where, scratch, env)
            if msg:
                failures.append(msg)
        for cmd in block.commands:
            msg = check_command(cmd, where, scratch, env)
            if msg:
                failures.append(msg)
    return failures
