"""Fuzzing: hostile and broken dumps through the reader and every command that takes a dump.

Cases start from valid dumps (seeded random ones and the bundled samples) and mutate them:
truncation in every region, bit flips, metadata of wrong types, huge/negative sizes and offsets,
overlapping spans, wrong dtypes and ranks, inconsistent counts, non-UTF-8 and control-character
names, plus special files (empty, a directory, a FIFO, a Git LFS pointer, ...). Every case must end
in exit 2 with one line `dcptool: FILE: problem` (the reader's DumpError, word for word), or in a
correct report -- never a traceback, a hang or a large allocation.

    make test    # CI size (DCPTOOL_FUZZ=ci): a few thousand cases, derandomized
    make fuzz    # DCPTOOL_FUZZ=long: 50k+ random cases

The commands list (COMMANDS) is what to extend when a command that takes a dump appears.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gzip
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import traceback
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import typer
from conftest import ROOT, cli, cli_subprocess, count_fuzz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dcptool.check.replay import RULES, local_np, replay
from dcptool.cli import app
from dcptool.dump import (
    MAX_DCP_SIZE,
    MAX_HEADER_BYTES,
    DumpConfig,
    DumpError,
    Observation,
    open_dumps,
    write_observations,
)

PROFILE = os.environ.get("DCPTOOL_FUZZ", "ci")
# Random cases per command (CI: 300 x 9 commands, plus ~2100 exhaustive single-field cases); `make fuzz`
# sets DCPTOOL_FUZZ=long (10k per command, or DCPTOOL_FUZZ_EXAMPLES; not derandomized: new cases every run).
EXAMPLES = int(os.environ.get("DCPTOOL_FUZZ_EXAMPLES", 0)) or {"smoke": 60, "ci": 300, "long": 10_000}[PROFILE]
CASE_SECONDS = 30  # a case taking this long is a hang (a normal one takes milliseconds)
MEMORY_BOUND = 256 << 20  # bytes one case of a few-kB file may map beyond what the process holds
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=PROFILE == "ci", database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture], print_blob=True)
# odd-but-valid dumps (each runs 10 commands): CI 120, long 10x the random cases per command
FUZZ_ODD = settings(FUZZ, max_examples=max(int(EXAMPLES // 2.5), 20) if PROFILE != "long" else EXAMPLES)
VALUE_RULES = ("stale", "global", "wrong-rank", "wrong-interleave", "mismatch")


# --------------------------------------------------------------------------------------------
# Valid dumps to start from


def _observations(rng: np.random.Generator, dcp: int, il: int, page: int | None) -> list[Observation]:
    """A few observations with every kind of view (right, None, wrong, short, sentinel) and columns."""
    out: list[Observation] = []
    sizes = [0, 1, 2, 3, 5] * 5 + [127, 128, 129]
    with_qsl, with_ub, with_buf = rng.random(3) < 0.5
    for _ in range(int(rng.choice([0, 1, 2, 3, 4, 6, 9]))):
        nr = int(rng.choice(sizes))
        nrp = nr + int(rng.choice([0, 0, 1, 3]))
        rows = nrp if rng.random() < 0.9 else nr
        seq = rng.choice([0, 1, 7, 16, 17, 100, 1000, 4097, 2**31 - 1], size=rows, p=[.1, .1, .1, .1, .1, .2, .2,
                                                                                       .09, .01]).astype(np.int32)
        seq[nr:] = 0
        rank = int(rng.integers(dcp))
        view = np.zeros(nrp, np.int64)
        view[:nr] = local_np(seq[:nr], dcp, rank, il)
        kind = rng.choice(["ok"] * 6 + ["none", "wrong", "global", "short", "sentinel", "rank"])
        if kind == "none":
            view = None
        elif kind == "wrong" and nr:
            view[int(rng.integers(nr))] += 1
        elif kind == "global":
            view[:nr] = seq[:nr]
        elif kind == "short":
            view = view[:nr]
        elif kind == "sentinel" and nrp > nr:
            view[nr:] = -1
        elif kind == "rank" and dcp > 1:
            view[:nr] = local_np(seq[:nr], dcp, (rank + 1) % dcp, il)
        kw: dict = {}
        if with_qsl:
            kw["query_start_loc"] = np.concatenate([[0], np.cumsum(rng.integers(0, 4, size=rows))]).astype(np.int32)
            kw["num_tokens_padded"] = int(kw["query_start_loc"][-1]) + int(rng.integers(0, 3))
        if with_ub and out and rng.random() < 0.5:
            kw.update(parent=int(rng.integers(len(out))), req_start=0, tok_start=0, tok_stop=int(rng.integers(0, 9)))
        if with_buf:
            kw.update(buffer=int(rng.choice([0, 4096, 8192])), graph=int(rng.integers(4)))
        if page:
            kw["kv_pages"] = -(-local_np(seq, dcp, rank, il) // page) + (rng.random() < 0.1)
        out.append(Observation(step=int(rng.integers(0, 4)), site=str(rng.choice(["attn_metadata", "ubatch", "dummy"])),
                               rank=rank, num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq,
                               dcp_local_seq_lens=None if view is None else view.astype(np.int32),
                               ubatch=int(rng.integers(-1, 2)) if with_ub else -1, **kw))
    return out


SAMPLES = sorted((ROOT / "samples").glob("*.safetensors"))  # what simulate writes, and the handmade one
SAMPLE = ROOT / "samples" / "handmade.safetensors"  # the small one: 14 observations, every kind of finding


@functools.cache
def base_bytes(seed: int) -> bytes:
    """Seed < 0: a bundled sample; otherwise a random valid dump written through the real writer."""
    if seed < 0:
        return SAMPLES[seed].read_bytes()
    rng = np.random.default_rng(seed)
    dcp = int(rng.choice([1, 2, 2, 3, 4, 8]))
    il = int(rng.choice([1, 1, 2, 16]))
    page = int(rng.choice([16, 64])) if rng.random() < 0.3 else None
    obs = _observations(rng, dcp, il, page)
    injected = {"sentinel": [i for i in range(len(obs)) if rng.random() < 0.3]} if rng.random() < 0.3 else None
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dcptool-fuzz-base-{os.getpid()}-{seed}.safetensors"
    try:
        write_observations(path, obs, DumpConfig(dcp_size=dcp, cp_interleave=il, page_size=page, engine="fuzz"),
                           injected)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def split(raw: bytes) -> tuple[dict, bytearray]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), bytearray(raw[8 + n :])


def join(header: dict, data: bytes, pad: bool = True) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(data)


# --------------------------------------------------------------------------------------------
# Mutations: structural ones edit the parsed header/data; byte-level ones the final bytes

INTS = [-(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, 3, 7, 127, 128, 129, 1024, 2**31 - 1, 2**31, 2**32,
        2**53 + 1, 2**60, 2**63 - 1, 2**63, 2**64, 2**64 + 1]
VALUES = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 127, 128, 2**31 - 1, 2**63 - 1]  # per-element extremes
JUNK = [None, True, False, 1.5, float("inf"), "2", "", "x" * 5000, [], {}, [1], {"a": 1}, "\ud800", "a\nb",
        "\x00", "é", "\U0001f600", 10**400]
DTYPES = ["I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "F32", "F16", "BF16", "F64", "BOOL", "F4", "C64",
          "XX", "", "i32", 5, None]
TEXT = ["", "a", "\ud800", "\udcff", "a\nb", "\x1b[31mred", "é", "\u202e", "x" * 300, "a/b", "\U0001f600"]
DT = {"I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "U32": "<u4", "U64": "<u8",
      "F32": "<f4", "F64": "<f8", "F16": "<f2"}


def _tensors(h: dict) -> list[str]:
    return sorted(k for k, v in h.items() if k != "__metadata__" and isinstance(v, dict))


def _shift(h: dict, at: int, delta: int) -> None:
    """Move every tensor that starts at or after byte `at` by delta (keeping the file consistent)."""
    for k in _tensors(h):
        o = h[k].get("data_offsets")
        if isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o) and o[0] >= at:
            h[k]["data_offsets"] = [o[0] + delta, o[1] + delta]


def _span(h: dict, k: str) -> tuple[int, int] | None:
    """A tensor's byte span when it is sane and a whole number of its elements."""
    e = h[k]
    o = e.get("data_offsets")
    size = np.dtype(DT[e["dtype"]]).itemsize if e.get("dtype") in DT else 1
    if isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o) and 0 <= o[0] <= o[1] \
            and (o[1] - o[0]) % size == 0:
        return o[0], o[1]
    return None


def _replace_span(h: dict, data: bytearray, k: str, new: bytes) -> bool:
    s = _span(h, k)
    if s is None or s[1] > len(data):
        return False
    a, b = s
    data[a:b] = new
    _shift(h, b, len(new) - (b - a))
    h[k]["data_offsets"] = [a, a + len(new)]
    return True


@st.composite
def structural(draw, h: dict, data: bytearray) -> str:
    """Apply one structural mutation in place; returns a description (hypothesis notes it)."""
    keys = _tensors(h)
    kind = draw(st.sampled_from(["meta", "config", "entry", "drop", "add", "value", "resize", "retype", "rank",
                                 "text", "swap", "injected"]))
    meta = h.get("__metadata__")
    if not isinstance(meta, dict):  # an earlier mutation broke it; this one starts a new one
        meta = h["__metadata__"] = {}
    if kind == "meta":
        key = draw(st.sampled_from(["dcptool.format", "dcptool.config", "dcptool.injected", "other", None]))
        if key is None:
            h["__metadata__"] = draw(st.sampled_from(JUNK[:12]))
            return f"__metadata__ = {h['__metadata__']!r}"[:200]
        v = draw(st.sampled_from(["<del>", "2", "", "1 ", "01", "0", "{", "[]", "null", '"x"', "{}"] + JUNK[:10]))
        if v == "<del>":
            meta.pop(key, None)
        else:
            meta[key] = v
        return f"meta {key} = {v!r}"[:200]
    if kind == "config":
        try:
            c = json.loads(meta.get("dcptool.config", "{}"))
        except (TypeError, ValueError):
            c = {}
        if not isinstance(c, dict):
            c = {}
        field = draw(st.sampled_from(["dcp_size", "cp_interleave", "pcp_size", "page_size", "sites", "engine",
                                      "engine_version", "note", "unknown"]))
        v = draw(st.sampled_from(["<del>"] + INTS + JUNK + [[s] for s in TEXT] + [["a"] * 3000]))
        if v == "<del>":
            c.pop(field, None)
        else:
            c[field] = v
        meta["dcptool.config"] = json.dumps(c)
        return f"config {field} = {v!r}"[:200]
    if kind == "injected":
        v = draw(st.sampled_from([{"f": [0]}, {"f": [-1]}, {"f": [10**6]}, {"f": "x"}, {"\ud800": []}, [],
                                  {"f": [1.5]}, {"f": [[0]]}, {"f": list(range(5))}]))
        meta["dcptool.injected"] = json.dumps(v)
        return f"injected = {v!r}"
    if not keys:
        return "no tensors"
    k = draw(st.sampled_from(keys))
    e = h[k]
    if kind == "entry":
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "<all>"]))
        s = _span(h, k) or (0, 0)
        n = e["shape"][0] if isinstance(e.get("shape"), list) and e["shape"] and type(e["shape"][0]) is int else 1
        others = [_span(h, o) for o in keys if o != k and _span(h, o)]
        pools = {
            "dtype": DTYPES,
            "shape": [[], [n, 1], [1, n], [-1], [2**60], [2**64], [1.5], "n", None, [n + 1], [max(n - 1, 0)], [0],
                      [2**62] * 40, [n, 0], [0, 2**62], [True]],
            "data_offsets": [[s[0], s[1] + 1], [s[0] - 1, s[1]], [-1, s[1]], [s[1], s[0]], [0, 2**60], [0, 2**64],
                             [s[0]], [s[0], s[1], 0], [1.5, 2], None, [s[0] + 1, s[1] + 1], [2**63, 2**63 + 4]]
            + [[a, a + s[1] - s[0]] for a, _ in others[:3]],
            "<all>": [None, [], "x", 7],
        }
        v = draw(st.sampled_from(pools[field]))
        if field == "<all>":
            h[k] = v
        else:
            e[field] = v
        return f"{k}.{field} = {v!r}"[:200]
    if kind == "drop":
        del h[k]
        return f"drop {k}"
    if kind == "add":
        name = draw(st.sampled_from(["obs.extra", "obs.parent", "obs.qsl", "rows.kv_pages", "obs.graph",
                                     "obs.buffer", "zzz"]))
        if name in h:
            return f"add {name}: exists"
        n = draw(st.sampled_from([0, 1, 2, 5]))
        dt = draw(st.sampled_from(["I64", "I32", "I8", "F32"]))
        raw = np.zeros(n, DT[dt]).tobytes()
        h[name] = {"dtype": dt, "shape": [n], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
        return f"add {name} {dt}[{n}]"
    if kind in ("value", "resize", "retype"):
        s = _span(h, k)
        dt = e.get("dtype")
        if s is None or dt not in DT or s[1] > len(data) or (kind == "value" and s[1] == s[0]):
            return f"{kind} {k}: no data"
        a = np.frombuffer(bytes(data[s[0] : s[1]]), DT[dt]).copy()
    if kind == "value":
        j = draw(st.integers(0, a.size - 1))
        info = np.iinfo(a.dtype) if a.dtype.kind in "iu" else None
        pool = [v for v in INTS + [int(a[j]) + 1, int(a[j]) - 1, a.size, a.size + 1]
                if info is None or info.min <= v <= info.max]
        v = draw(st.sampled_from(pool))
        a[j] = v
        data[s[0] : s[1]] = a.tobytes()
        return f"{k}[{j}] = {v}"
    if kind == "resize":
        delta = draw(st.sampled_from([-3, -1, 1, 2, 100]))
        new = a[: max(a.size + delta, 0)] if delta < 0 else np.concatenate([a, np.repeat(a[-1:] if a.size else
                                                                                          np.zeros(1, a.dtype), delta)])
        _replace_span(h, data, k, new.astype(a.dtype).tobytes())
        e["shape"] = [int(new.size)]
        return f"resize {k} by {delta}"
    if kind == "retype":
        to = draw(st.sampled_from(["I64", "I32", "I16", "U8", "I8", "U32", "F32", "F64"]))
        with np.errstate(invalid="ignore"):  # NaN or inf to an integer type: whatever bits, on purpose
            _replace_span(h, data, k, a.astype(DT[to]).tobytes())
        e["dtype"] = to
        return f"retype {k} {dt} -> {to}"
    if kind == "rank":
        shape = e.get("shape")
        n = shape[0] if isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int else None
        if n is None:
            return f"rank {k}: not 1-D"
        e["shape"] = draw(st.sampled_from([[n, 1], [1, n], [1, 1, n]] + ([[]] if n == 1 else [])))
        return f"{k}.shape = {e['shape']}"
    if kind == "text":
        t = draw(st.sampled_from(TEXT))
        where = draw(st.sampled_from(["key", "site", "engine", "note", "fault"]))
        if where == "key":
            h[t] = h.pop(k)
        elif where == "fault":
            meta["dcptool.injected"] = json.dumps({t: []})
        else:
            try:
                c = json.loads(meta.get("dcptool.config", "{}"))
                c["sites" if where == "site" else where] = [t] * 3 if where == "site" else t
                meta["dcptool.config"] = json.dumps(c)
            except (TypeError, ValueError, AttributeError):
                pass
        return f"text {where} = {t!r}"[:200]
    # swap: two spans of equal length trade places (a consistent file with crossed columns)
    same = [o for o in keys if o != k and _span(h, o) and _span(h, k)
            and _span(h, o)[1] - _span(h, o)[0] == _span(h, k)[1] - _span(h, k)[0]]
    if not same:
        return f"swap {k}: no partner"
    o = draw(st.sampled_from(same))
    h[k]["data_offsets"], h[o]["data_offsets"] = h[o]["data_offsets"], h[k]["data_offsets"]
    return f"swap {k} <-> {o}"


@st.composite
def byte_level(draw, raw: bytes) -> tuple[bytes, str]:
    (hlen,) = struct.unpack("<Q", raw[:8]) if len(raw) >= 8 else (0,)
    regions = {"prefix": (0, 8), "header": (8, min(8 + hlen, len(raw))), "data": (min(8 + hlen, len(raw)), len(raw))}
    kind = draw(st.sampled_from(["truncate", "flip", "length", "trailing", "header"]))
    region = draw(st.sampled_from(sorted(regions)))
    a, b = regions[region]
    if kind == "truncate":
        at = draw(st.integers(a, max(a, b - 1)))
        return raw[:at], f"truncate at {at} ({region} {a}..{b})"
    if kind == "flip":
        out = bytearray(raw)
        flips = draw(st.lists(st.integers(a, max(a, b - 1)), min_size=1, max_size=4))
        bit = draw(st.integers(0, 7))
        for i in flips:
            if i < len(out):
                out[i] ^= 1 << bit
        return bytes(out), f"flip bit {bit} at {flips}"
    if kind == "length":
        v = draw(st.sampled_from([0, 1, 2, hlen - 1, hlen + 1, hlen + 8, hlen - 8, len(raw) - 8, len(raw), 2**60,
                                  2**64 - 1, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1]))
        return struct.pack("<Q", max(v, 0) % 2**64) + raw[8:], f"header length = {v}"
    if kind == "trailing":
        junk = draw(st.sampled_from([b"\x00", b"\x00" * 8, b"junk", b"\xff" * 100]))
        return raw + junk, f"{len(junk)} trailing bytes"
    h = raw[8 : 8 + hlen]
    new = draw(st.sampled_from([b"\xff\xfe" + h[2:], h.replace(b'"', b"'", 1), b"[" * 100_000, b"[]", b"null",
                                b'"x"', b"{}", h.rstrip(b" ") + b"\x00", b'{"a":' * 5000, h[: len(h) // 2],
                                b"{" + b'"k":{},' * 2000 + b'"z":1}', b'{"__metadata__":{"dcptool.format":"1"}}']))
    return struct.pack("<Q", len(new)) + new + raw[8 + hlen :], f"header bytes = {new[:40]!r}..."


class Case(bytes):
    """A mutated file's bytes, shown (in a failure report) as the steps that made it."""

    steps: list[str]

    def __repr__(self) -> str:
        return " | ".join(self.steps)


@st.composite
def mutated(draw) -> Case:
    """A valid dump, 1-3 structural mutations, then (sometimes) one byte-level mutation."""
    seed = draw(st.integers(-len(SAMPLES), 63))
    h, data = split(base_bytes(seed))
    steps = [f"base {seed}"]
    for _ in range(draw(st.integers(0, 3))):
        steps.append(draw(structural(h, data)))
    raw = join(h, data, pad=draw(st.booleans()))
    if len(steps) == 1 or draw(st.booleans()):
        raw, what = draw(byte_level(raw))
        steps.append(what)
    case = Case(raw)
    case.steps = steps
    return case


# --------------------------------------------------------------------------------------------
# Special files: what people actually pass by mistake

SPECIALS = ["empty", "directory", "fifo", "missing", "dangling-link", "link-loop", "lfs-pointer", "text", "png",
            "gzip", "random", "zeros", "prefix-only", "plain-safetensors", "pickle", "newline-name",
            "non-utf8-name", "dir-named-like-dump"]


def make_special(kind: str, d: Path) -> Path:
    p = d / f"{kind}.safetensors"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind in ("directory", "dir-named-like-dump"):
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "missing":
        pass
    elif kind == "dangling-link":
        p.symlink_to(d / "nowhere")
    elif kind == "link-loop":
        p.symlink_to(p)
    elif kind == "lfs-pointer":
        p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 12345\n")
    elif kind == "text":
        p.write_text("step,site,rank\n0,attn,0\n")
    elif kind == "png":
        p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    elif kind == "gzip":
        p.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    elif kind == "random":
        p.write_bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "zeros":
        p.write_bytes(bytes(1024))
    elif kind == "prefix-only":
        p.write_bytes(struct.pack("<Q", 16))
    elif kind == "plain-safetensors":  # a model checkpoint, not a dcptool dump
        x = np.arange(6, dtype="<f4").tobytes()
        p.write_bytes(join({"weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, len(x)]}}, x))
    elif kind == "pickle":
        p.write_bytes(b"\x80\x04\x95" + bytes(60))
    elif kind == "newline-name":
        p = d / "two\nlines.safetensors"
        p.write_bytes(SAMPLE.read_bytes()[:100])
    elif kind == "non-utf8-name":
        p = Path(os.fsdecode(os.fsencode(str(d)) + b"/bad\xff\xfename.safetensors"))
        p.write_bytes(SAMPLE.read_bytes()[:100])
    return p


# --------------------------------------------------------------------------------------------
# The oracle: one reader verdict per file, and every command must agree with it


class Hang(BaseException):
    """A case ran past CASE_SECONDS (BaseException: no `except Exception` in the code may swallow it)."""


def _vm_data() -> int:
    """This process's data segment (what RLIMIT_DATA limits), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


@contextlib.contextmanager
def bounded(memory: int = MEMORY_BOUND, seconds: int = CASE_SECONDS):
    """Run a case under a deadline and a memory bound.

    SIGALRM raises Hang between bytecodes; a hang inside C code that never returns is caught by
    faulthandler, which dumps every thread's stack and ends the run. RLIMIT_DATA caps what the case
    may map beyond what the process holds already: an allocation sized from a declared (not real)
    size fails at once as MemoryError -- even one numpy would only reserve -- and fails the case.
    """
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hang(f"case ran past {seconds} s")))
    limits = resource.getrlimit(resource.RLIMIT_DATA)
    faulthandler.dump_traceback_later(seconds * 4, exit=True)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + memory, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, limits)
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


@dataclass
class Verdict:
    """What the reader makes of a file: its DumpError message, or the opened dump."""

    error: str | None
    dump: object = None


def one_line_error(msg: str, path: Path) -> None:
    assert "\n" not in msg and "\r" not in msg, f"error message spans lines: {msg!r}"
    assert 10 < len(msg) < 1200, f"error message too short or too long: {msg!r}"
    name = path.name
    shown = name if name.isprintable() else name.encode("unicode_escape", "backslashreplace").decode("ascii")
    assert shown[:150] in msg, f"error message does not name the file {shown!r}: {msg!r}"
    assert msg.split(": ", 1)[-1].strip(), f"error message does not say what is wrong: {msg!r}"


def read(path: Path) -> Verdict:
    try:
        d = open_dumps([path])
    except DumpError as e:
        one_line_error(str(e), path)
        return Verdict(error=str(e))
    return Verdict(error=None, dump=d)


def expected_findings(d) -> dict[tuple[int, str], dict]:
    """An independent account of docs/replay.md's per-observation rules, in plain Python from the columns:
    missing / one value rule (first wrong real row) / padding / shape / stray."""
    c = d.config
    want: dict[tuple[int, str], dict] = {}
    nr_all, nrp_all, ranks = d["obs.num_reqs"], d["obs.num_reqs_padded"], d["obs.rank"]
    span = c.dcp_size * c.cp_interleave
    for i in range(d.n):
        view = d.dcp_of(i)
        nr, nrp = int(nr_all[i]), int(nrp_all[i])
        if c.dcp_size == 1:
            if view is not None:
                want[(i, "stray")] = {}
            continue
        if view is None:
            want[(i, "missing")] = {}
            continue
        seq = d.seq_lens_of(i)
        r = int(ranks[i])
        for j in range(min(view.size, nr)):
            L = int(seq[j])
            exp = (L // span) * c.cp_interleave + min(max(L % span - r * c.cp_interleave, 0), c.cp_interleave)
            if int(view[j]) != exp:
                want[(i, "value")] = {"row": j, "recorded": int(view[j]), "expected": exp}
                break
        bad_pad = [j for j in range(nr, min(view.size, nrp)) if view[j] != 0]
        if bad_pad:
            want[(i, "padding")] = {"row": bad_pad[0], "recorded": int(view[bad_pad[0]]), "expected": 0}
        if view.size != nrp:
            want[(i, "shape")] = {}
    return want


def check_report(d, findings: list[dict], summary: dict) -> None:
    """Replay's findings (JSON form) against expected_findings, and the summary against the findings."""
    got: dict[tuple[int, str], dict] = {}
    for f in findings:
        assert f["rule"] in RULES and 0 <= f["obs"] < d.n and f["severity"] in ("error", "warning")
        assert f["message"] and "\n" not in f["message"]
        kind = "value" if f["rule"] in VALUE_RULES else f["rule"]
        if kind in ("value", "padding", "shape", "missing", "stray"):
            assert (f["obs"], kind) not in got, f"two {kind} findings for observation {f['obs']}"
            got[(f["obs"], kind)] = {k: f[k] for k in ("row", "recorded", "expected")} if kind in (
                "value", "padding") else {}
    want = expected_findings(d)
    assert got == want, f"replay's value findings differ from the rules: got {got}, want {want}"
    order = [(f["obs"], RULES.index(f["rule"])) for f in findings]
    assert order == sorted(order), "findings are not in observation order, then table order"
    assert summary["findings"] == len(findings) == summary["errors"] + summary["warnings"]
    assert sum(summary["by_rule"].values()) == summary["findings"] and summary["observations"] == d.n
    assert summary["errors"] == sum(f["severity"] == "error" for f in findings)


def _library(path: Path, v: Verdict) -> None:
    """The library route: replay() on the opened dump (torch backend: the CPU path CI has)."""
    if v.error is None:
        res = replay(v.dump, "torch")
        check_report(v.dump, [f.to_json() for f in res.findings], json.loads(json.dumps(res.summary_json())))


def _replay_json(out: str, v: Verdict, code: int) -> None:
    lines = [json.loads(x) for x in out.splitlines()]
    assert lines and lines[-1]["type"] == "summary"
    check_report(v.dump, [x for x in lines if x["type"] == "finding"], lines[-1])
    assert code == (1 if lines[-1]["errors"] else 0)


def _replay_split_obs(out: str, v: Verdict, code: int) -> None:
    lines = [json.loads(x) for x in out.splitlines()]
    rows = [x for x in lines if x["type"] == "rows"]
    assert len(rows) == 1 and rows[0]["obs"] == 0 and lines[-1]["type"] == "summary"
    assert len(rows[0]["verdict"]) >= int(v.dump["obs.num_reqs_padded"][0])
    assert code == (1 if lines[-1]["errors"] else 0)


def _inspect_json(out: str, v: Verdict, code: int) -> None:
    (info,) = [json.loads(x) for x in out.splitlines()]
    d = v.dump
    assert code == 0 and info["observations"] == d.n and info["with_view"] + info["without_view"] == d.n
    assert sum(info["sites"].values()) == d.n and sum(info["ranks"].values()) == d.n


def _text(out: str, v: Verdict, code: int) -> None:
    assert out.strip() and code in (0, 1)


def _diff_lines(out: str, code: int) -> tuple[list[dict], dict]:
    lines = [json.loads(x) for x in out.splitlines()]
    s = lines[-1]
    diffs = [x for x in lines[:-1] if x["type"] == "difference"]
    assert s["type"] == "summary" and len(diffs) == len(lines) - 1 == s["differences"]
    assert sum(s["by_field"].values()) == s["differences"] and code == (1 if s["differences"] else 0)
    assert all(x["message"] and "\n" not in x["message"] for x in diffs)
    return diffs, s


def _diff_self(out: str, v: Verdict, code: int) -> None:
    """A dump against itself: every observation aligned, nothing different."""
    diffs, s = _diff_lines(out, code)
    assert not diffs and s["compared"] == v.dump.n == s["a_observations"] == s["b_observations"]


def _diff_sample(out: str, v: Verdict, code: int) -> None:
    diffs, s = _diff_lines(out, code)
    assert s["b_observations"] == v.dump.n and s["compared"] <= min(s["a_observations"], v.dump.n)
    assert s["only_in_a"] == s["a_observations"] - s["compared"] and s["only_in_b"] == v.dump.n - s["compared"]


def _html(out: str, v: Verdict, code: int) -> None:
    page = HTML_OUT.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    HTML_OUT.unlink()


@dataclass(frozen=True)
class Command:
    """A way to use a dump: CLI arguments (FILE is the dump) and what a good run must print.

    `args` None is the library route; OUT is a file the command writes. To fuzz a new command that
    takes a dump (e.g. `diff FILE BASE`), add it here.
    """

    name: str
    args: tuple[str, ...] | None
    check: object
    stderr: str = ""  # what a good run prints on stderr (OUT replaced)


COMMANDS = [
    Command("library", None, _library),
    Command("replay", ("replay", "FILE", "--json"), _replay_json),
    Command("replay-text", ("replay", "FILE", "--max-findings", "3"), _text),
    Command("replay-split-obs", ("replay", "FILE", "--split", "2", "--obs", "0", "--json"), _replay_split_obs),
    Command("inspect", ("inspect", "FILE", "--json"), _inspect_json),
    Command("inspect-text", ("inspect", "FILE"), _text),
    Command("replay-html", ("replay", "FILE", "--html", "OUT", "--force"), _html, stderr="dcptool: wrote OUT\n"),
    Command("diff-self", ("diff", "FILE", "FILE", "--json"), _diff_self),
    Command("diff-sample", ("diff", "SAMPLE", "FILE", "--json"), _diff_sample),
]

HTML_OUT = Path(os.environ.get("TMPDIR", "/tmp")) / f"dcptool-fuzz-{os.getpid()}.html"
RUNNER = CliRunner()
CLICK = typer.main.get_command(app)  # built once: typer rebuilds it on every CliRunner.invoke


def invoke(args: list[str]) -> tuple[int, str, str, BaseException | None]:
    """`dcptool ARGS` in this process, as `python -m dcptool` runs it: (exit code, stdout, stderr, crash)."""
    crash = None
    with RUNNER.isolation() as (out, err, _):
        try:
            CLICK.main(args=args, prog_name="dcptool")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:
            code, crash = 1, e
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode(), crash


def run_command(cmd: Command, path: Path, v: Verdict) -> None:
    if cmd.args is None:
        cmd.check(path, v)
        return
    code, out, err, crash = invoke([{"FILE": str(path), "OUT": str(HTML_OUT), "SAMPLE": str(SAMPLE)}.get(a, a)
                                    for a in cmd.args])
    if crash is not None:
        raise AssertionError(f"{cmd.name} raised:\n" + "".join(traceback.format_exception(crash)))
    assert code in (0, 1, 2), code
    if v.error is not None:
        assert code == 2, f"{cmd.name} exit {code} on a file the reader rejects ({v.error})"
        want = v.error
        if path.is_dir():  # every command reads a directory as the dumps inside it
            want = f"{path}: directory holds no *.safetensors dump"
        assert err == f"dcptool: {want}\n" and out == "", (out, err)
        return
    if code == 2:  # a usage problem on a readable file: --obs 0 of an empty dump, or of a huge batch
        assert "--obs" in cmd.args and err.startswith("dcptool replay: --obs") and err.count("\n") == 1, err
        assert ("has no observation 0" in err and v.dump.n == 0) or "too large to show row by row" in err, err
        return
    assert err == cmd.stderr.replace("OUT", str(HTML_OUT)), err
    cmd.check(out, v, code)


def run_case(path: Path, cmd: Command | None) -> Verdict:
    """One case: the reader's verdict, then the command, under the deadline and memory bound."""
    with bounded():
        v = read(path)
        if cmd is not None:
            run_command(cmd, path, v)
    return v


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Run every command once first (imports are not a case's memory), torch single-threaded.

    The cases are tiny; on a shared 2-core machine torch's thread pool hand-offs cost more than the work.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    p = tmp_path_factory.mktemp("warm") / "base.safetensors"
    p.write_bytes(SAMPLE.read_bytes())
    v = read(p)
    for cmd in COMMANDS:
        run_command(cmd, p, v)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("seed", [*range(-len(SAMPLES), 0), *range(16)])
def test_bases_are_valid_and_replay_correctly(seed, tmp_path):
    """The starting points read, and replay reports exactly what the rules say (the oracle itself)."""
    p = tmp_path / "base.safetensors"
    p.write_bytes(base_bytes(seed))
    v = read(p)
    assert v.error is None
    _library(p, v)


def test_oracle_catches_a_wrong_report(tmp_path):
    """check_report is not vacuous: a dropped finding, a wrong row or a wrong count is caught."""
    p = tmp_path / "base.safetensors"
    p.write_bytes(SAMPLE.read_bytes())
    d = read(p).dump
    res = replay(d, "torch")
    good = [f.to_json() for f in res.findings]
    summary = res.summary_json()
    check_report(d, good, summary)
    value = next(i for i, f in enumerate(good) if f["rule"] in VALUE_RULES)
    for broken in (good[1:], [{**f, "row": f["row"] + 1} if i == value else f for i, f in enumerate(good)],
                   good[::-1]):
        with pytest.raises(AssertionError):
            check_report(d, broken, {**summary, "findings": len(broken)})
    with pytest.raises(AssertionError):
        check_report(d, good, {**summary, "errors": summary["errors"] + 1})


def test_bound_catches_a_large_allocation_and_a_hang():
    """The harness's own guards work: a 1 GB allocation and a busy loop both fail the case."""
    with pytest.raises(MemoryError), bounded():
        np.ones(1 << 27)  # 1 GB of float64
    with pytest.raises(Hang), bounded(seconds=1):
        while True:
            pass


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.name for c in COMMANDS])
@FUZZ
@given(case=mutated())
def test_fuzz_command(cmd, case, case_dir, warm):
    p = case_dir / "case.safetensors"
    p.write_bytes(case)
    run_case(p, cmd)
    count_fuzz(f"mutated/{cmd.name}")


# --------------------------------------------------------------------------------------------
# Every single field, every hostile value: deterministic, so CI never depends on luck for these


def full_base() -> bytes:
    """A valid dump with every optional column (parents, slices, qsl, buffers, graphs, page counts)."""
    seq = np.array([64, 96, 512, 32, 48], np.int32)
    qsl = np.array([0, 1, 2, 12, 13, 14], np.int32)
    view = local_np(seq, 2, 0, 1).astype(np.int32)
    full = Observation(step=3, site="attn_metadata", rank=0, num_reqs=5, num_reqs_padded=5, seq_lens=seq,
                       dcp_local_seq_lens=view, query_start_loc=qsl, num_tokens_padded=16, buffer=4096, graph=2,
                       kv_pages=-(-view // 16))
    sub = Observation(step=3, site="ubatch", rank=0, ubatch=1, num_reqs=3, num_reqs_padded=3, seq_lens=seq[2:],
                      dcp_local_seq_lens=view[2:], parent=0, req_start=2, tok_start=7, tok_stop=16,
                      query_start_loc=np.array([0, 5, 6, 7], np.int32), buffer=8192, graph=3,
                      kv_pages=-(-view[2:] // 16))
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dcptool-fuzz-full-{os.getpid()}.safetensors"
    try:
        write_observations(path, [full, sub], DumpConfig(dcp_size=2, page_size=16, engine="fuzz"),
                           {"sentinel": [1]})
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def single_mutations(group: str):
    """(description, file bytes) for every one-field change of full_base() in a group."""
    import copy

    h0, d0 = split(full_base())
    c0 = json.loads(h0["__metadata__"]["dcptool.config"])
    if group == "config":
        for field in ("dcp_size", "cp_interleave", "pcp_size", "page_size", "sites", "engine", "engine_version",
                      "note", "unknown"):
            for v in ["<del>", *INTS, *JUNK, *([s] for s in TEXT), ["attn_metadata", "attn_metadata"]]:
                h = copy.deepcopy(h0)
                c = {k: x for k, x in c0.items() if not (k == field and v == "<del>")}
                if v != "<del>":
                    c[field] = v
                h["__metadata__"]["dcptool.config"] = json.dumps(c)
                yield f"config {field} = {v!r}"[:120], join(h, d0)
    elif group == "metadata":
        for key in ("dcptool.format", "dcptool.config", "dcptool.injected", "x"):
            for v in ["<del>", "2", "", "1 ", "{", "[]", "null", "{}", '{"f": [5]}', '{"f": [-1]}', *JUNK]:
                h = copy.deepcopy(h0)
                if v == "<del>":
                    h["__metadata__"].pop(key, None)
                else:
                    h["__metadata__"][key] = v
                yield f"metadata {key} = {v!r}"[:120], join(h, d0)
        for v in JUNK:
            yield f"__metadata__ = {v!r}"[:120], join({**h0, "__metadata__": v}, d0)
    elif group == "entry":
        for key in _tensors(h0):
            a, b = _span(h0, key)
            n = h0[key]["shape"][0]
            pools = {"dtype": DTYPES, "shape": [[], [n, 1], [1, n], [-1], [2**60], [2**64], [1.5], "n", None,
                                                [n + 1], [max(n - 1, 0)], [0], [2**62] * 40, [n, 0], [True]],
                     "data_offsets": [[a, b + 1], [a - 1, b], [-1, b], [b, a], [0, 2**60], [0, 2**64], [a], None,
                                      [a, b, 0], [1.5, 2], [a + 1, b + 1], [2**63, 2**63 + 4], [0, b - a]]}
            for field, pool in pools.items():
                for v in pool:
                    h = copy.deepcopy(h0)
                    h[key][field] = v
                    yield f"{key}.{field} = {v!r}"[:120], join(h, d0)
            yield f"drop {key}", join({k: x for k, x in h0.items() if k != key}, d0)
    elif group == "value":
        for key in _tensors(h0):
            a, b = _span(h0, key)
            arr = np.frombuffer(bytes(d0[a:b]), DT[h0[key]["dtype"]])
            info = np.iinfo(arr.dtype)
            for j in sorted({0, arr.size - 1}):
                for v in VALUES + [int(arr[j]) + 1, int(arr[j]) - 1]:
                    if info.min <= v <= info.max and v != arr[j]:
                        x = arr.copy()
                        x[j] = v
                        d = bytearray(d0)
                        d[a:b] = x.tobytes()
                        yield f"{key}[{j}] = {v}", join(h0, d)


@pytest.mark.parametrize("group", ["config", "metadata", "entry", "value"])
def test_every_single_field_mutation(group, case_dir, warm):
    """Each case through the reader; a readable one through the library replay (the oracle) and the
    text report, where a value of an unexpected type would surface (e.g. a null pcp_size)."""
    text = next(c for c in COMMANDS if c.name == "replay-text")
    library = next(c for c in COMMANDS if c.args is None)
    n = readable = 0
    for what, raw in single_mutations(group):
        p = case_dir / "single.safetensors"
        p.write_bytes(raw)
        try:
            v = run_case(p, None)
            if v.error is None:
                readable += 1
                run_case(p, library)
                run_case(p, text)
        except (AssertionError, Exception) as e:
            raise AssertionError(f"{group}: {what}: {e}") from e
        n += 1
    count_fuzz(f"single/{group}", n)
    assert n > 50 and 0 < readable < n  # both outcomes occur: the mutations are not all fatal or all harmless


@pytest.mark.parametrize("kind", SPECIALS)
def test_special_files(kind, tmp_path, warm):
    p = make_special(kind, tmp_path)
    v = run_case(p, None)
    assert v.error is not None, f"{kind} was accepted"
    for cmd in COMMANDS:
        run_case(p, cmd)
        count_fuzz(f"special/{cmd.name}")
    if kind == "lfs-pointer":
        assert "Git LFS pointer" in v.error
    if kind in ("directory", "dir-named-like-dump"):
        assert "is a directory" in v.error
    if kind == "fifo":
        assert "not a regular file" in v.error


# --------------------------------------------------------------------------------------------
# Memory: declared sizes are checked against the file before anything is allocated


def traced_peak(fn, *args):
    """(result, peak bytes numpy and Python allocated while fn ran), measured with tracemalloc."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = fn(*args)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _declared(tmp_path: Path, name: str, header: dict, data: bytes = b"", hlen: int | None = None) -> Path:
    p = tmp_path / name
    raw = join(header, data)
    if hlen is not None:
        raw = struct.pack("<Q", hlen) + raw[8:]
    p.write_bytes(raw)
    return p


@pytest.mark.parametrize("what", ["header-100MB", "header-2^63", "tensor-2^60-bytes", "shape-2^62-squared",
                                  "offsets-past-end", "many-dims", "num_reqs_padded-int32-max",
                                  "dcp_size-int32-max"])
def test_declared_sizes_allocate_nothing(what, tmp_path, warm):
    """A small file declaring huge sizes is rejected (or replayed) without allocating anything near them."""
    h, data = split(SAMPLE.read_bytes())
    hlen = None
    if what == "header-100MB":
        hlen = MAX_HEADER_BYTES
    elif what == "header-2^63":
        hlen = 2**63
    elif what == "tensor-2^60-bytes":
        h["obs.step"] = {"dtype": "I64", "shape": [2**57], "data_offsets": [0, 2**60]}
    elif what == "shape-2^62-squared":
        h["obs.step"]["shape"] = [2**62, 2**62]
    elif what == "offsets-past-end":
        h["rows.seq_lens"]["data_offsets"] = [0, 2**40]
    elif what == "many-dims":
        h["zz"] = {"dtype": "I32", "shape": [2**62] * 20_000, "data_offsets": [0, 0]}
    elif what == "num_reqs_padded-int32-max":
        s = _span(h, "obs.num_reqs_padded")
        data[s[0] : s[1]] = np.full((s[1] - s[0]) // 4, 2**31 - 1, "<i4").tobytes()
    elif what == "dcp_size-int32-max":
        c = json.loads(h["__metadata__"]["dcptool.config"])
        c["dcp_size"], c["cp_interleave"] = 2**31 - 1, 1
        h["__metadata__"]["dcptool.config"] = json.dumps(c)
    p = _declared(tmp_path, f"{what}.safetensors", h, data, hlen)
    size = p.stat().st_size
    assert size < 3_000_000
    for cmd in COMMANDS:
        v, peak = traced_peak(run_case, p, cmd)
        assert peak < 16 * size + (8 << 20), f"{cmd.name}: a {size}-byte file cost {peak} bytes"
    count_fuzz("declared-sizes", len(COMMANDS))
    if what.startswith(("header", "tensor", "shape", "offsets", "many")):
        assert v.error is not None


@pytest.mark.parametrize("body", ["empty-lists", "empty-objects", "short-strings", "numbers", "nested"])
def test_hostile_header_json_is_bounded(body, tmp_path):
    """A real 20 MB header made of tiny JSON values is refused before json builds millions of objects."""
    n = 20 << 20
    unit = {"empty-lists": b"[],", "empty-objects": b"{},", "short-strings": b'"ab",', "numbers": b"1234567,",
            "nested": b"["}[body]
    inner = unit * (n // len(unit))
    raw = b'{"__metadata__":{"dcptool.format":"1"},"x":[' + inner.rstrip(b",") + b"]}"
    if body == "nested":
        raw = b'{"x":' + inner
    raw += b" " * (-len(raw) % 8)
    p = tmp_path / "hostile.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    v, peak = traced_peak(run_case, p, None)
    assert v.error is not None and ("too many JSON values" in v.error or "not UTF-8 JSON" in v.error), v.error
    assert peak < 3 * len(raw), f"a {len(raw)}-byte header cost {peak} bytes"  # json.loads: 10-25x
    count_fuzz("hostile-json")


def test_large_legitimate_header_reads(tmp_path):
    """The bound does not hurt a real dump with a long `dcptool.injected` index list (1M indices)."""
    obs = [Observation(step=0, site="a", rank=0, num_reqs=1, num_reqs_padded=1, seq_lens=np.array([5]),
                       dcp_local_seq_lens=np.array([3]))]
    p = tmp_path / "big-header.safetensors"
    write_observations(p, obs, DumpConfig(dcp_size=2), {"sentinel": [0] * 1_000_000})
    d, peak = traced_peak(open_dumps, [p])
    assert len(d.injected[0]["sentinel"]) == 1_000_000
    assert peak < 10 * p.stat().st_size


# --------------------------------------------------------------------------------------------
# Real processes: no traceback escapes `python -m dcptool`

SUBPROCESS_CASES = [("empty", "inspect"), ("directory", "replay"), ("fifo", "inspect"), ("lfs-pointer", "replay"),
                    ("plain-safetensors", "inspect"), ("non-utf8-name", "replay"), ("newline-name", "inspect"),
                    ("gzip", "replay")]


@pytest.mark.parametrize("kind,command", SUBPROCESS_CASES)
def test_cli_subprocess_special(kind, command, tmp_path):
    p = make_special(kind, tmp_path)
    real = kind in ("fifo", "non-utf8-name")  # a process where fds or argv bytes are the point; else in-process
    r = (cli_subprocess if real else cli)(command, p, "--json")
    assert r.returncode == 2, r
    assert r.stdout == "" and r.stderr.count("\n") == 1 and r.stderr.startswith("dcptool: "), r.stderr
    assert "Traceback" not in r.stderr
    count_fuzz("subprocess" if real else "cli")


def _mutant(seed: int, how: str) -> bytes:
    rng = np.random.default_rng(seed)
    h, data = split(base_bytes(int(rng.integers(0, 64))) if how != "value" else SAMPLE.read_bytes())
    raw = join(h, data)
    cut = int(rng.integers(9, len(raw)))
    if how == "value":  # still valid: a changed seq_len makes wrong views, not a bad file
        a, b = _span(h, "rows.seq_lens")
        data[int(rng.integers(a, b))] ^= 0x10
        return join(h, data)
    if how == "truncate":
        return raw[:cut]
    if how == "flip":
        return raw[:cut] + bytes([raw[cut] ^ 0x40]) + raw[cut + 1 :]
    return struct.pack("<Q", 2**40 + cut) + raw[8:]


MUTANTS = [(1, "truncate", "replay"), (2, "flip", "inspect"), (3, "length", "replay"), (4, "truncate", "inspect"),
           (5, "value", "replay")]


@pytest.mark.parametrize("seed,how,command", MUTANTS)
def test_cli_subprocess_mutated(seed, how, command, tmp_path):
    """Seeded mutated dumps through real processes: the exit code and stderr the reader predicts."""
    p = tmp_path / f"m{seed}.safetensors"
    p.write_bytes(_mutant(seed, how))
    try:
        open_dumps([p])
        want = None
    except DumpError as e:
        want = str(e)
    if how == "value":
        assert want is None, want
    real = seed == 1  # one real process; the rest in-process, through the same guard
    r = (cli_subprocess if real else cli)(command, p, "--json")
    assert "Traceback" not in r.stderr, r.stderr
    if want is not None:
        assert r.returncode == 2 and r.stdout == "" and r.stderr == f"dcptool: {want}\n", r.stderr
    else:
        assert r.returncode in (0, 1) and r.stderr == "", r.stderr
        summary = json.loads(r.stdout.splitlines()[-1])
        assert summary["type"] == "summary" and r.returncode == (1 if summary["errors"] else 0)
    count_fuzz("subprocess" if real else "cli")


def test_cli_subprocess_non_utf8_name_with_findings(tmp_path):
    """A readable dump under a non-UTF-8 name: the text report prints the name's own bytes.

    PYTHONIOENCODING=utf-8 makes stdout strict, as a UTF-8 locale other than C does."""
    name = b"r\xffn.safetensors"
    p = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/" + name))
    p.write_bytes(SAMPLE.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "PYTHONIOENCODING": "utf-8"}
    for args, code in ((["replay", p], 1), (["inspect", p], 0)):
        r = subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], capture_output=True, env=env,
                           timeout=300)
        assert r.returncode == code and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
        assert name in r.stdout
        count_fuzz("subprocess")



# --------------------------------------------------------------------------------------------
# Whatever the reader accepts replays: odd but structurally valid dumps, written
# through dcptool's own writer, through every command. Mutations above mostly produce files the reader
# rejects; these are all accepted, so every check, slicer and renderer has to cope with their values.

ODD_INTS = (-1, 0, 1, 2, 3, 5, 7, 16, 2**31 - 1)
ODD_SEQ = (0, 1, 2, 7, 16, 17, 100, 2**31 - 1)


@st.composite
def odd_dump(draw) -> tuple[list[Observation], DumpConfig]:
    """Observations the writer (hence the reader) accepts, with the values real engines never record: zero
    rows, num_reqs 0 with padding, views of any length, query_start_loc that runs backwards or past the
    batch, parents pointing anywhere (later observations too), slice bounds past the parent, micro-batch
    indices in the billions, dcp_size 1 and the reader's largest (MAX_DCP_SIZE), steps at the ends of int64."""
    dcp = draw(st.sampled_from([1, 1, 2, 2, 3, 4, 8, MAX_DCP_SIZE]))
    il = draw(st.sampled_from([1, 1, 2, 16])) if dcp < 2**30 else 1
    page = draw(st.sampled_from([None, None, 1, 16]))
    n = draw(st.integers(0, 6))
    small = st.integers(0, 4)
    opt = st.sampled_from(ODD_INTS + (0, 0, 1, 2))  # small values often: slices that reach the slicing checks
    with_qsl, with_slice, with_buf = (draw(st.booleans()) for _ in range(3))
    out = []
    for i in range(n):
        nr = draw(small)
        nrp = nr + draw(st.sampled_from([0, 0, 1, 2, 3] + ([2**31 - 1 - nr] if nr < 3 else [])))
        rows = draw(st.integers(nr, min(nrp, nr + 3) + 2))
        seq = np.array(draw(st.lists(st.sampled_from(ODD_SEQ), min_size=rows, max_size=rows)), np.int32)
        view = draw(st.one_of(st.none(), st.lists(st.sampled_from((-1, 0, 1, 8, 2**31 - 1)), max_size=6)))
        if view is not None and draw(st.booleans()):  # the right view (padded), so checks go past the rules
            good = np.zeros(min(nrp, 8), np.int64)
            good[: min(nr, good.size)] = local_np(seq[: min(nr, good.size)], dcp, 0, il)
            view = good.tolist()
        kw: dict = {}
        if with_slice or (with_qsl and draw(st.booleans())):
            kind = draw(st.sampled_from(["cumsum", "any", "empty-batch"]))
            if kind == "cumsum":
                q = np.concatenate([[0], np.cumsum(draw(st.lists(st.integers(0, 5), min_size=rows, max_size=rows)))])
            else:
                q = np.array(draw(st.lists(st.sampled_from(ODD_INTS + (-7,)), min_size=rows + 1, max_size=rows + 1)))
            kw["query_start_loc"] = q.astype(np.int32)
            kw["num_tokens_padded"] = draw(opt)
        ub = draw(st.sampled_from([-1, -1, 0, 1, 2, 2**31 - 1]))
        if with_slice and i and draw(st.integers(0, 3)):
            ub = max(ub, 0)
            kw.update(parent=draw(st.sampled_from([0, 0, i - 1, n - 1, -1]).filter(lambda p, i=i: p != i)),
                      req_start=draw(opt), tok_start=draw(opt), tok_stop=draw(opt))
        if with_buf:
            kw.update(buffer=draw(st.sampled_from([0, 4096, 8192])), graph=draw(st.integers(0, 3)))
        if page:
            kw["kv_pages"] = np.array(draw(st.lists(st.sampled_from((-1, 0, 1, 2, 2**31 - 1)), min_size=rows,
                                                    max_size=rows)), np.int32)
        out.append(Observation(
            step=draw(st.sampled_from([0, 0, 1, 2, -(2**63), 2**63 - 1])),
            site=draw(st.sampled_from(["attn_metadata", "ubatch", "dummy", "capture"])),
            rank=draw(st.sampled_from([0, 1, dcp - 1])) % dcp, num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq,
            dcp_local_seq_lens=None if view is None else np.array(view, np.int32),
            ubatch=ub, **kw))
    return out, DumpConfig(dcp_size=dcp, cp_interleave=il, page_size=page, pcp_size=draw(st.sampled_from([1, 2])),
                           engine="fuzz")


ODD_COMMANDS = (("inspect", "FILE", "--json"), ("replay", "FILE", "--max-findings", "5"),
                ("replay", "FILE", "--json"), ("replay", "FILE", "--html", "OUT", "--force"),
                ("replay", "FILE", "--split", "2", "--json"), ("replay", "FILE", "--obs", "0"),
                ("replay", "FILE", "--obs", "0", "--json"), ("diff", "FILE", "FILE", "--json"),
                ("diff", "FILE", "OTHER"), ("diff", "SAMPLE", "FILE", "--json"))


@FUZZ_ODD
@given(case=odd_dump(), other=odd_dump())
def test_every_accepted_dump_replays(case, other, case_dir, warm):
    """Whatever the writer writes and `inspect` accepts, every command ends with exit 0 or 1 and no
    exception (exit 2 only for `--obs 0` of an empty dump or of a batch too large to show row by row)."""
    p, q = case_dir / "odd.safetensors", case_dir / "odd-other.safetensors"
    write_observations(p, *case)
    write_observations(q, *other)
    subs = {"FILE": str(p), "OTHER": str(q), "OUT": str(HTML_OUT), "SAMPLE": str(SAMPLE)}
    with bounded():
        for args in ODD_COMMANDS:
            code, out, err, crash = invoke([subs.get(a, a) for a in args])
            if crash is not None:
                raise AssertionError(f"{' '.join(args)} raised:\n" + "".join(traceback.format_exception(crash)))
            if code == 2 and "--obs" in args:
                assert err.startswith("dcptool replay: --obs") and err.count("\n") == 1, err
                assert "has no observation 0" in err or "too large to show row by row" in err, err
                continue
            assert code in ((0,) if args[0] == "inspect" else (0, 1)), (args, code, err)
            if args[0] == "diff" and args[1] == args[2]:
                assert code == 0, f"a dump differs from itself: {out[-500:]}"
    HTML_OUT.unlink(missing_ok=True)
    count_fuzz("odd-dump")


def test_micro_batch_without_rows_replays(tmp_path):
    """num_reqs 0, num_reqs_padded 2 and no seq_lens rows: the reader accepts it (only num_reqs rows are
    required), so the slicing check reports it (a 0-row slice of a 2-request range) instead of reading past
    its rows (it was an IndexError in check_ubatch_slice)."""
    seq = np.array([64, 96, 512, 32, 48], np.int32)
    full = Observation(step=3, site="attn_metadata", rank=0, num_reqs=5, num_reqs_padded=5, seq_lens=seq,
                       dcp_local_seq_lens=local_np(seq, 2, 0, 1).astype(np.int32),
                       query_start_loc=np.array([0, 1, 2, 12, 13, 14], np.int32))
    sub = Observation(step=3, site="ubatch", rank=0, ubatch=1, num_reqs=0, num_reqs_padded=2,
                      seq_lens=np.zeros(0, np.int32), dcp_local_seq_lens=np.zeros(2, np.int32), parent=0,
                      req_start=2, tok_start=7, tok_stop=14, query_start_loc=np.array([0], np.int32))
    ok = Observation(**{**sub.__dict__, "num_reqs": 2, "seq_lens": np.array([512, 32], np.int32),
                        "dcp_local_seq_lens": local_np(np.array([512, 32]), 2, 0, 1).astype(np.int32),
                        "query_start_loc": np.array([0, 5, 6], np.int32)})
    p, good = tmp_path / "ub.safetensors", tmp_path / "good.safetensors"
    write_observations(p, [full, sub], DumpConfig(dcp_size=2))
    write_observations(good, [full, ok], DumpConfig(dcp_size=2))
    for args in (["replay", str(p), "--json"], ["replay", str(p), "--split", "2"], ["replay", str(p), "--obs", "1"],
                 ["diff", str(p), str(good)]):
        code, out, err, crash = invoke(args)
        assert crash is None and code == 1 and err == "", (args, crash, err)
    lines = [json.loads(x) for x in invoke(["replay", str(p), "--json"])[1].splitlines()]
    assert [(x["obs"], x["rule"]) for x in lines if x["type"] == "finding"] == [(1, "ubatch-slice")]
    code, out, err, crash = invoke(["replay", str(good), "--json"])  # the same slice with its rows: clean
    assert (code, crash) == (0, None), out
