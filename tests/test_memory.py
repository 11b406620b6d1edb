"""memory.keep_freed_memory: glibc keeps freed blocks for reuse; only the command line sets it."""

import platform
import subprocess
import sys

import pytest

from dcptool import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

_PROBE = """
import sys
from dcptool.memory import keep_freed_memory
if sys.argv[1] == "set":
    assert keep_freed_memory()
import numpy as np
a = np.ones(4 << 20, np.float32); first = a.ctypes.data; del a  # 16 MB: past glibc's default mmap threshold
b = np.ones(4 << 20, np.float32)
print(b.ctypes.data == first)
"""


@glibc
@pytest.mark.parametrize("mode,reused", [("set", "True"), ("default", "False")])
def test_a_freed_block_is_reused_only_when_set(mode, reused):
    """By default glibc maps a 16 MB block afresh and unmaps it on free (a new block: page faults on every
    touch); set, the second array takes the first one's memory. A fresh process: the setting is process-wide."""
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == reused


def test_without_mallopt_it_says_so(monkeypatch):
    """Not glibc (no mallopt in the C library): False, nothing set, no error."""
    class NoMallopt:
        def __init__(self, *a, **k):
            pass

    monkeypatch.setattr(memory.ctypes, "CDLL", NoMallopt)
    assert memory.keep_freed_memory() is False


def test_the_command_line_sets_it(monkeypatch):
    import dcptool.cli as cli

    calls = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["dcptool", "--help"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0 and calls == [1]
