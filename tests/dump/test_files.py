"""dump/files.py: the file side of a read: the header's checks, positioned reads, a file changing while it is read."""

import json
import os
import re
import struct

import numpy as np
import pytest
from conftest import obs, write

from dcptool.dump import DumpError, files, read_dump


def test_not_safetensors_and_truncation(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"")
    with pytest.raises(DumpError, match="not a safetensors file"):
        read_dump(p)
    p.write_bytes(b"hello world, not a dump at all")
    with pytest.raises(DumpError, match=r"not a safetensors file \(it is text: 'hello world"):
        read_dump(p)
    p.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    with pytest.raises(DumpError, match="Git LFS pointer"):
        read_dump(p)
    with pytest.raises(DumpError, match="is a directory"):
        read_dump(tmp_path)
    with pytest.raises(DumpError, match="cannot read"):
        read_dump(tmp_path / "nope.safetensors")
    good = write(tmp_path / "g.safetensors", [obs(), obs(step=1)])
    raw = open(good, "rb").read()
    for cut in (4, 12, len(raw) // 2, len(raw) - 1):
        t = tmp_path / f"cut{cut}.safetensors"
        t.write_bytes(raw[:cut])
        with pytest.raises(DumpError, match="truncated|not a safetensors|size mismatch"):
            read_dump(t)
    t = tmp_path / "long.safetensors"
    t.write_bytes(raw + b"\0" * 8)
    with pytest.raises(DumpError, match="size mismatch"):
        read_dump(t)


def test_header_too_large_is_refused_before_reading(tmp_path):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(DumpError, match="header too large"):
        read_dump(p)


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace", "append"])
def test_file_changing_while_read_is_one_line(tmp_path, monkeypatch, change):
    """A file truncated, rewritten in place, replaced (rename) or appended to between its header and its
    data: exit 2 and one line naming it, never an IndexError, a ValueError or a SIGBUS."""
    from typer.testing import CliRunner

    from dcptool.cli import app

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(50)])
    raw = open(p, "rb").read()
    real = files.header_of

    def header_then_change(path, f):
        out = real(path, f)
        if change == "truncate":
            os.truncate(p, len(raw) - 100)
        elif change == "rewrite":  # same size, other bytes, a later mtime
            with open(p, "r+b") as g:
                g.seek(len(raw) - 8)
                g.write(b"\xff" * 8)
            st = os.stat(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        elif change == "replace":  # the path now names another file; the open one is the old: consistent
            q = tmp_path / "new.safetensors"
            write(q, [obs(step=99)])
            os.replace(q, p)
        else:
            with open(p, "ab") as g:
                g.write(b"\0" * 64)
        return out

    monkeypatch.setattr(files, "header_of", header_then_change)
    r = CliRunner().invoke(app, ["replay", p, "--json"])
    if change == "replace":  # read from the descriptor opened first: the old file, whole and unchanged
        assert r.exit_code == 0 and json.loads(r.stdout.splitlines()[-1])["observations"] == 50
        return
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dcptool: {p}: changed while being read"), r.stderr


# --------------------------------------------------------------------------------------------
# The helpers one by one


@pytest.mark.parametrize("preadv", [True, False], ids=["preadv", "pread"])
def test_pread_reads_a_range_into_the_buffer_and_a_short_file_is_one_dump_error(tmp_path, monkeypatch, preadv):
    """Bytes [at, at + n) land at buf[at - base:]; a file that ends before them (it was `size` bytes when opened)
    is the file's DumpError, with or without os.preadv."""
    if not preadv:
        monkeypatch.delattr(os, "preadv")
    raw = np.random.default_rng(11).integers(0, 256, 100, dtype=np.uint8)
    p = tmp_path / "short.bin"
    p.write_bytes(raw.tobytes())
    with open(p, "rb") as f:
        buf = np.zeros(60, np.uint8)
        files.pread(str(p), f, buf, 30, 50, 20, 100)
        assert buf[10:60].tolist() == raw[30:80].tolist() and not buf[:10].any()
        files.pread(str(p), f, buf, 20, 0, 20, 100)  # nothing asked: nothing read, no error
        ended = f"{p}: changed while being read: the file ended after 100 of 120 bytes"
        with pytest.raises(DumpError, match=re.escape(ended)):
            files.pread(str(p), f, np.zeros(40, np.uint8), 80, 40, 80, 120)


def test_read_header_gives_the_header_where_the_data_starts_and_the_size(tmp_path):
    p = write(tmp_path / "a.safetensors", [obs(), obs(step=1)])
    header, data_start, size = files.read_header(p)
    (hlen,) = struct.unpack("<Q", open(p, "rb").read(8))
    assert data_start == 8 + hlen and size == os.path.getsize(p)
    assert header["__metadata__"]["dcptool.format"] == "1" and header["obs.step"]["shape"] == [2]
    with pytest.raises(DumpError, match="is a directory"):
        files.read_header(tmp_path)
    with pytest.raises(DumpError, match="cannot read"):
        files.read_header(tmp_path / "nope.safetensors")


def test_open_file_refuses_what_is_not_a_regular_file(tmp_path):
    """A FIFO would block the read forever: refused before it is opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DumpError, match="is not a regular file"):
        files.open_file(str(fifo))
    with pytest.raises(DumpError, match="is not a regular file"):
        read_dump(fifo)


def test_check_unchanged_compares_size_mtime_and_inode(tmp_path):
    p = write(tmp_path / "a.safetensors", [obs()])
    with open(p, "rb") as f:
        before = os.fstat(f.fileno())
        files.check_unchanged(p, f, before)  # the same file: nothing to say
        with open(p, "ab") as g:
            g.write(b"\0")
        with pytest.raises(DumpError, match="^" + re.escape(f"{p}: changed while being read")):
            files.check_unchanged(p, f, before)


def test_read_data_copies_the_data_section(tmp_path):
    p = write(tmp_path / "a.safetensors", [obs(step=s) for s in range(3)])
    _header, data_start, size = files.read_header(p)
    with open(p, "rb") as f:
        data = files.read_data(p, f, data_start, size, os.fstat(f.fileno()))
    assert data.dtype == np.uint8 and data.tobytes() == open(p, "rb").read()[data_start:]


def test_release_pages_keeps_the_values_of_a_mapped_column(tmp_path):
    """Dropping a copy-on-write mapping's pages loses nothing: they are read from the file again when touched."""
    import mmap

    values = np.random.default_rng(5).integers(0, 1 << 30, 5 * mmap.PAGESIZE, dtype=np.int32)
    p = tmp_path / "col.bin"
    p.write_bytes(values.tobytes())
    with open(p, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    col = np.frombuffer(m, np.int32)
    assert col.sum() == values.sum()
    files.release_pages((m, 0, 4), 100, values.size - 100)  # whole pages inside [100, size - 100) only
    files.release_pages((m, 0, 4), 50, 50)  # an empty range: nothing
    assert np.array_equal(col, values)
    del col
    m.close()


def test_available_memory_is_bytes_or_none(monkeypatch):
    got = files.available_memory()
    assert got is None or (isinstance(got, int) and got > 0)

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)
    assert files.available_memory() is None
