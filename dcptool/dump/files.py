"""The file side of reading a dump: header, positioned reads, the unchanged-file check, page release."""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from dcptool.dump.schema import (
    MAX_HEADER_BYTES,
    fail,
    loads,
    sniff,
    text_ok,
)

# --------------------------------------------------------------------------------------------
# Reading


def open_file(p: str):
    """Open a dump file for reading: a regular file, else DumpError (a FIFO would block, a directory fail)."""
    st = os.stat(p)
    if stat.S_ISDIR(st.st_mode):
        raise fail(p, None, "is a directory, not a dump file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise fail(p, None, "is not a regular file (a pipe, socket or device); save the dump to a file first")
    f = open(p, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced between the stat and the open
        f.close()
        raise fail(p, None, "is not a regular file (a pipe, socket or device); save the dump to a file first")
    return f


def header_of(p: str, f) -> tuple[dict, int, int]:
    """Parse and check the safetensors header of the open file f; returns (header, data start, file size)."""
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        start = f.read(72)
        if size < 8 or len(start) < 8:
            raise fail(p, None, f"not a safetensors file ({size} bytes; a dump starts with an 8-byte "
                                 "header length)" if size else "not a safetensors file (empty: 0 bytes)")
        if start.startswith(b"version ") and b"git-lfs" in start.split(b"\n")[0]:
            raise fail(p, None, "is a Git LFS pointer, not the dump itself (run `git lfs pull`)")
        if start[8:9] not in (b"", b"{"):  # a safetensors header is a JSON object
            raise fail(p, None, f"not a safetensors file ({sniff(start)})")
        (hlen,) = struct.unpack("<Q", start[:8])
        f.seek(8)
        if hlen > MAX_HEADER_BYTES:
            raise fail(p, None, f"not a safetensors file, or header too large ({hlen} bytes > "
                                 f"{MAX_HEADER_BYTES})")
        if 8 + hlen > size:
            raise fail(p, None, f"truncated: header declares {hlen} bytes but the file has {size - 8}")
        raw = f.read(hlen)
        if len(raw) != hlen:
            raise fail(p, None, f"truncated while reading: header declares {hlen} bytes, read {len(raw)}")
    except OSError as e:
        raise fail(p, None, f"cannot read: {e.strerror or e}") from None
    header = loads(p, None, raw, "not a safetensors file (header is not UTF-8 JSON)")
    if not isinstance(header, dict):
        raise fail(p, None, "not a safetensors file (header is not a JSON object)")
    bad = next((k for k in header if not text_ok(k)), None)
    if bad is not None:
        raise fail(p, bad, "tensor name is not valid Unicode (a lone surrogate escape)")
    return header, 8 + hlen, size


def read_header(path: str | os.PathLike) -> tuple[dict, int, int]:
    """Parse and check the safetensors header; returns (header, data start, file size)."""
    p = os.fspath(path)
    try:
        f = open_file(p)
    except OSError as e:
        raise fail(p, None, f"cannot read: {e.strerror or e}") from None
    with f:
        return header_of(p, f)


def available_memory() -> int | None:
    """Bytes of memory available now (None where the OS does not say): the free pages, or more where Linux's
    MemAvailable counts page cache the kernel can reclaim. Free pages alone are few on a machine whose cache holds
    a dump just written, and a dump judged too large for them is mapped instead of read: the one way of reading
    that a truncation by another process can end with SIGBUS."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        with open("/proc/meminfo", "rb") as f:
            avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:")), 0)
    except (OSError, ValueError, IndexError):
        avail = 0
    return max(free, avail)


@dataclass(frozen=True)
class MemoryPlan:
    """How a set of files is read: into memory, or bounded (row columns mapped, pages dropped after each read),
    and why: the files' bytes against the memory available (None where the OS does not say)."""

    bounded: bool
    dump_bytes: int
    available: int | None
    forced: bool = False  # the caller chose (bounded=True or False), not the memory available

    def reason(self) -> str:
        """Why the set is read as it is, in words (the CLI's line on stderr)."""
        size = f"{self.dump_bytes / 1e9:.1f} GB"
        if self.forced:
            return f"{size} read {'in bounded memory' if self.bounded else 'into memory'}, as asked"
        if self.available is None:
            return f"{size} read into memory (the memory available is not known here)"
        avail = f"{self.available / 1e9:.1f} GB"
        if self.bounded:
            return (f"{size} read in bounded memory: over half the memory available ({avail}); "
                    "DCPTOOL_BOUNDED=0 reads it into memory")
        return f"{size} read into memory: up to half the memory available ({avail})"


def memory_plan(paths: list[str | os.PathLike], bounded: bool | None = None) -> MemoryPlan:
    """In memory when the files together take up to half the memory available now, else bounded; `bounded`
    (True or False) decides instead."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except OSError:
            pass  # the reader reports it
    if bounded is not None:
        return MemoryPlan(bool(bounded), total, None, forced=True)
    avail = available_memory()
    return MemoryPlan(avail is not None and total > avail // 2, total, avail)


def check_unchanged(p: str, f, before: os.stat_result) -> None:
    """DumpError if the open file f is no longer what was stat'ed as `before` (size, mtime, inode, device)."""
    after = os.fstat(f.fileno())
    if (before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev) != (
            after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev):
        raise fail(p, None, "changed while being read (size or modification time differ from when it was "
                             "opened); read it again once it is complete")


def read_data(p: str, f, data_start: int, size: int, before: os.stat_result) -> np.ndarray:
    """The file's data section, copied into memory, and proof that the file did not change meanwhile."""
    # np.empty, not bytearray: no zero-filling pass before the read, and numpy asks for huge pages on large
    # blocks (half the read time of a 234 MB dump here: 0.06 s against 0.13 s)
    buf = np.empty(size - data_start, np.uint8)
    pread(p, f, buf, data_start, size - data_start, data_start, size)
    check_unchanged(p, f, before)
    return buf


def pread(p: str, f, buf, at: int, nbytes: int, base: int, size: int) -> None:
    """Bytes [at, at + nbytes) of the file (of `size` bytes when opened) into buf[at - base:] (an array or a
    memoryview; os.preadv: no shared file position, and the GIL released while the kernel copies); DumpError if it
    ends early."""
    view = memoryview(buf)[at - base : at - base + nbytes]
    got = 0
    while got < nbytes:
        if hasattr(os, "preadv"):
            k = os.preadv(f.fileno(), [view[got:]], at + got)
        else:  # (a system without preadv: one more copy)
            b = os.pread(f.fileno(), min(nbytes - got, 1 << 26), at + got)
            k = len(b)
            view[got : got + k] = b
        if not k:
            raise fail(p, None, f"changed while being read: the file ended after {at + got} of {size} bytes "
                                 "(truncated by another process?); read it again once it is complete")
        got += k


def release_pages(m: tuple, lo: int, hi: int) -> None:
    """Drop the pages holding elements [lo, hi) of a mapped column (mmap, byte offset, itemsize) from
    this process (the file is untouched)."""
    mm, off, itemsize = m
    if hi <= lo or not hasattr(mm, "madvise"):
        return
    import mmap

    a = off + lo * itemsize
    b = off + hi * itemsize
    page = mmap.PAGESIZE
    a = -(-a // page) * page
    b = b // page * page
    if b > a:
        mm.madvise(mmap.MADV_DONTNEED, a, b - a)
