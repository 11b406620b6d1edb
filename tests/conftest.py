"""Shared test helpers: hand-built observations, dumps and their replay, the kernels' devices, and the CLI (in-process,
or as a real subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from dcptool.dcp.reference import expected_rows, local_np
from dcptool.dump import DumpConfig, Observation, open_dumps, write_dump, write_observations

ROOT = Path(__file__).resolve().parents[1]


def expected_view(seq, num_reqs: int, num_reqs_padded: int, dcp: int, rank: int, il: int = 1) -> np.ndarray:
    out = np.zeros(num_reqs_padded, np.int32)
    out[:num_reqs] = local_np(np.asarray(seq[:num_reqs]), dcp, rank, il)
    return out


def obs(step=0, site="attn_metadata", rank=0, seq=(17, 25, 0, 0), num_reqs=2, num_reqs_padded=4, dcp=2, il=1,
        view="auto", **kw) -> Observation:
    """A correct observation unless `view` says otherwise ("auto" = the right view, None = missing)."""
    seq = np.asarray(seq, np.int32)
    if isinstance(view, str) and view == "auto":
        view = expected_view(seq, num_reqs, num_reqs_padded, dcp, rank, il)
    return Observation(step=step, site=site, rank=rank, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded,
                       seq_lens=seq, dcp_local_seq_lens=None if view is None else np.asarray(view, np.int32), **kw)


def write(path, observations, dcp=2, il=1, **cfg) -> str:
    write_observations(path, observations, DumpConfig(dcp_size=dcp, cp_interleave=il, **cfg))
    return str(path)


def run(tmp_path, observations, backend="torch", **cfg):
    """The replay of a dump of these observations."""
    from dcptool.check.replay import replay

    return replay(open_dumps([write(tmp_path / "d.safetensors", observations, **cfg)]), backend)


def rules(res):
    """A replay's findings as (observation, rule)."""
    return [(f.obs, f.rule) for f in res.findings]


def worked_example(copy_parent_rows: bool, rank: int = 0):
    """docs/dcp.md#micro-batches-dbo: query lens [1,1,10,1,1], seq_lens [64,96,512,32,48], K=2, N=2, I=1."""
    from dcptool.dcp.slicing import split_batch

    q = np.array([0, 1, 2, 12, 13, 14], np.int32)
    seq = np.array([64, 96, 512, 32, 48], np.int32)
    parent = obs(step=3, rank=rank, seq=seq, num_reqs=5, num_reqs_padded=5, query_start_loc=q)
    out = [parent]
    for u, ub in enumerate(split_batch(q, seq, 5, 5, None, 2)):
        sl = ub.slice
        view = (parent.dcp_local_seq_lens[sl.req_start:sl.req_stop] if copy_parent_rows
                else expected_view(ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, 2, rank))
        out.append(obs(step=3, rank=rank, site="ubatch", ubatch=u, seq=ub.seq_lens, num_reqs=ub.num_reqs,
                       num_reqs_padded=ub.num_reqs_padded, view=view, parent=0, req_start=sl.req_start,
                       tok_start=sl.tok_start, tok_stop=sl.tok_stop, query_start_loc=ub.query_start_loc))
    return out


def random_columns(rng, n, N, I, page=16, one_rank=False, kv=True) -> dict[str, np.ndarray]:
    """The one random-dump builder of the tests: n observations of awkward sizes (0, 1, 127, 128, 129, 300,
    1031 rows), mostly-right views with short/long/missing ones and a few wrong values (real and padded
    rows), page counts with a few wrong or unknown; the columns of docs/format.md."""
    lens = rng.choice([0, 1, 127, 128, 129, 300, 1031], size=n).astype(np.int64)
    nreq = np.array([rng.integers(0, x + 1) for x in lens])
    rank = np.zeros(n, np.int32) if one_rank else rng.integers(0, N, n).astype(np.int32)
    rows = np.zeros(n + 1, np.int64)
    rows[1:] = np.cumsum(lens)
    obs = np.repeat(np.arange(n), lens)
    j = np.arange(rows[-1]) - rows[obs]
    seq = np.where(j < nreq[obs], rng.integers(0, 1 << 20, rows[-1]), rng.integers(0, 3, rows[-1]) * 7)
    seq = seq.astype(np.int32)  # padded rows sometimes non-zero: the scan must still expect 0 there
    exp = expected_rows(torch.from_numpy(seq), torch.from_numpy(rows), torch.from_numpy(nreq),
                        torch.from_numpy(rank), N, I).numpy()
    has = (rng.random(n) > 0.1).astype(np.uint8)
    dlen = np.where(has == 1, lens, 0)
    odd = rng.random(n) < 0.1
    dlen[odd & (has == 1)] = np.maximum(lens[odd & (has == 1)] + rng.integers(-3, 4, int((odd & (has == 1)).sum())), 0)
    drows = np.zeros(n + 1, np.int64)
    drows[1:] = np.cumsum(dlen)
    dcp = np.concatenate([np.pad(exp[rows[i]:rows[i + 1]], (0, max(0, dlen[i] - lens[i])))[:dlen[i]]
                          for i in range(n)] + [np.zeros(0, np.int32)]).astype(np.int32)
    flip = rng.random(dcp.size) < 0.002
    dcp[flip] = rng.integers(-1, 9, int(flip.sum()))
    cols = {"obs.step": np.arange(n, dtype=np.int64), "obs.site": np.zeros(n, np.int32), "obs.rank": rank,
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": nreq.astype(np.int32),
            "obs.num_reqs_padded": lens.astype(np.int32), "obs.rows": rows, "obs.has_dcp": has,
            "obs.dcp_rows": drows, "rows.seq_lens": seq, "rows.dcp_local_seq_lens": dcp}
    if kv:
        pages = -(-exp.astype(np.int64) // page)
        pages[rng.random(pages.size) < 0.002] += 1
        pages[rng.random(pages.size) < 0.01] = -1  # unknown
        cols["rows.kv_pages"] = pages.astype(np.int32)
    return cols


def random_dump(path, rng, n, N, I, page=16, one_rank=False, kv=True):
    """random_columns written to `path` and opened."""
    cols = random_columns(rng, n, N, I, page, one_rank, kv)
    write_dump(path, DumpConfig(dcp_size=N, cp_interleave=I, sites=("x",), page_size=page if kv else None), cols)
    return open_dumps([str(path)])


def rollover_files(tmp_path, rng, n=240, files=4, sorted_steps=True, N=4, I=2):
    """Seeded random observations cut into `files` rollover files at random observation boundaries (an
    empty file among them when `files` > 4), steps repeated so that one step spans several files; with
    sorted_steps=False the steps are in no order at all (every file interleaves with every other)."""
    cols = random_columns(rng, n, N, I)
    cols["obs.step"] = (np.sort(rng.integers(0, n // 3, n)) if sorted_steps else rng.integers(0, 9, n)).astype(np.int64)
    cols["obs.site"] = rng.integers(0, 2, n).astype(np.int32)
    cols["obs.parent"] = np.full(n, -1, np.int64)
    cuts = np.concatenate([[0], np.sort(rng.integers(0, n + 1, files - 1)), [n]])
    if files > 4:
        cuts[2] = cuts[1]  # an empty file (a rollover with nothing recorded since)
    paths = []
    for f, (a, b) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist())):
        c = {}
        for k, v in cols.items():
            if k.startswith("obs.") and k not in ("obs.rows", "obs.dcp_rows"):
                c[k] = v[a:b].copy()
        if b - a > 1:  # parents within a file: a random earlier observation of the same file
            kids = np.flatnonzero(rng.random(b - a) < 0.3)
            kids = kids[kids > 0]
            c["obs.parent"][kids] = (rng.random(kids.size) * kids).astype(np.int64)
        for offs, keys in (("obs.rows", ["rows.seq_lens", "rows.kv_pages"]), ("obs.dcp_rows",
                                                                             ["rows.dcp_local_seq_lens"])):
            o = cols[offs]
            c[offs] = o[a : b + 1] - o[a]
            for k in keys:
                c[k] = cols[k][o[a] : o[b]]
        p = tmp_path / f"run.{f:05d}.safetensors"
        # each file names its sites in its own order: the merge must remap them
        sites = ("a", "b") if f % 2 == 0 else ("b", "a")
        if f % 2:
            c["obs.site"] = 1 - c["obs.site"]
        write_dump(p, DumpConfig(dcp_size=N, cp_interleave=I, sites=sites, page_size=16), c)
        paths.append(str(p))
    return paths


def with_gap(src, dst, before: str, gap: int = 8) -> str:
    """dst: src with `gap` bytes of no tensor inserted in the data section just before tensor `before` (the header's
    offsets moved to match): every tensor reads as before, but the data is not packed back to back."""
    import json
    import struct

    raw = open(src, "rb").read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + hlen]), raw[8 + hlen :]
    at = header[before]["data_offsets"][0]
    for k, v in header.items():
        if k != "__metadata__" and v["data_offsets"][0] >= at and v["data_offsets"][1] > at:
            v["data_offsets"] = [o + gap for o in v["data_offsets"]]
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data[:at] + b"\x07" * gap + data[at:])
    return str(dst)


HOSTILE = ("[/bold][link=https://example.invalid]L[/link][red]R[/] \x1b[2J\x1b]8;;https://example.invalid\x07X"
           "\x1b]8;;\x07\x1b]0;window title\x07\x07\rCR")


def hostile_dump(path, pages=True, none_step=1):
    """A dump whose site, engine, engine_version and note hold markup and escapes: two ranks, a None view at
    none_step, and (pages) a wrong page count. Written through dump.columns as the Recorder writes, but by the
    dump's other writer: the Recorder drops an observation whose site holds a control character (Hardening 6b),
    and a file may still hold one."""
    from dcptool import Recorder
    from dcptool.dump import read_dump

    config = DumpConfig(dcp_size=2, sites=(HOSTILE,), engine=HOSTILE, engine_version=HOSTILE, note=HOSTILE,
                        page_size=16 if pages else None)
    rec = Recorder(path, dcp_size=2, sites=(HOSTILE,), engine=HOSTILE, engine_version=HOSTILE, note=HOSTILE)
    with pytest.warns(RuntimeWarning, match="holds a control character"):
        assert rec.observe(step=0, site=HOSTILE, rank=0, seq_lens=[17, 25], num_reqs=2, num_reqs_padded=2) == -1
    rec.discard()
    observations = []
    for step in range(3):
        for rank in (0, 1):
            view = None if step == none_step else np.array([9, 13] if rank == 0 else [8, 12], np.int32)
            observations.append(Observation(step=step, site=HOSTILE, rank=rank, num_reqs=2, num_reqs_padded=2,
                                            seq_lens=np.array([17, 25], np.int32), dcp_local_seq_lens=view,
                                            kv_pages=np.array([9, 1], np.int32) if pages else None))
    write_observations(path, observations, config)
    assert read_dump(path).config.sites == (HOSTILE,) and rec.dropped == 1
    return str(path)


class Ran(NamedTuple):
    """What a finished `dcptool` run left: the fields of subprocess.CompletedProcess the tests read."""

    returncode: int
    stdout: str
    stderr: str
    args: tuple = ()


def _runner():
    from typer.testing import CliRunner

    try:  # click < 8.2 (older typer re-exports it) mixes stderr into stdout unless told not to
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 and typer's own runner keep them apart and have no such argument
        return CliRunner()


_CLICK: dict = {}


def _command(app):
    """The click command of dcptool's app, built once (typer rebuilds it on every `app()` call)."""
    if not _CLICK:
        import typer

        _CLICK["cmd"] = typer.main.get_command(app)
    return _CLICK["cmd"]


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def cli(*args, env=None, cwd=None) -> Ran:
    """`dcptool ARGS` in this process, through typer's CliRunner and dcptool.cli.main() as `python -m dcptool`
    runs it (its stdout set-up, then the guarded command group); `env` and `cwd` apply for the run only.
    Warnings reach stderr as they would in a process of its own (default filters), not pytest's record.
    An exception escaping main() is what a process would show: a traceback on stderr and exit 1."""
    import dcptool.cli as dcli

    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    overrides = {"COLUMNS": "200", **(env or {})}
    here, hook, app = os.getcwd(), sys.excepthook, dcli.app
    code = 0
    # dcptool.cli.main() calls `app()`, which rebuilds the command and reads sys.argv: run the built one instead
    dcli.app = lambda: _command(app).main(args=argv, prog_name="dcptool")
    try:
        if cwd is not None:
            os.chdir(cwd)
        with _runner().isolation(env=overrides) as streams, warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # Python's default filters, as in a fresh process
            warnings.showwarning = _show_warning
            try:
                dcli.main()
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if not isinstance(e.code, (int, type(None))):
                    sys.stderr.write(f"{e.code}\n")
            except Exception as e:
                code = 1
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            out, err = streams[0].getvalue(), streams[1].getvalue()
    finally:
        dcli.app, sys.excepthook = app, hook
        os.chdir(here)
    # bytes a non-UTF-8 file name put on stdout (main() writes them back, surrogate-escaped) survive the round trip
    return Ran(code, out.decode("utf-8", "surrogateescape"), err.decode("utf-8", "surrogateescape"), tuple(argv))


def cli_subprocess(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m dcptool ARGS` as a real process, as a user would; returns the finished process.
    For the few smoke tests that need a process: imports, signals, pipes, file descriptors, argv bytes."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=300)


def cli_pty(*args, cols: int = 80, rows: int = 24, env=None, cwd=None) -> tuple[int, str]:
    """Run `python -m dcptool ARGS` on a real pseudo-terminal of cols x rows, as a user at a terminal sees it:
    (exit code, everything written to the terminal, stdout and stderr together, \r\n as \n)."""
    import fcntl
    import pty
    import struct
    import termios

    e = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR")}
    e.update({"PYTHONPATH": str(ROOT), "TERM": "xterm-256color", **(env or {})})
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "dcptool", *map(str, args)], stdin=slave, stdout=slave,
                         stderr=slave, env=e, cwd=cwd, close_fds=True)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    code = p.wait(timeout=300)
    return code, out.decode("utf-8", "replace").replace("\r\n", "\n")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def screen_lines(text: str) -> list[str]:
    """What a terminal shows of `text`: its lines without colour and cursor codes (a progress bar's redraws
    included: \r returns to the line's start)."""
    lines = []
    for line in ANSI.sub("", text).split("\n"):
        lines.append(line.rsplit("\r", 1)[-1])
    return lines[:-1] if lines and lines[-1] == "" else lines


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def dev(request):
    """Where a kernel test runs: the CPU (Triton's interpreter), and the GPU where there is one."""
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("the Triton interpreter only runs without a GPU")
    return torch.device(request.param)


# Extremes of the int32 range the reader accepts: every backend and kernel must agree there.
I32 = 2**31 - 1
EXTREME_SEQ = [0, 1, 2, 15, 16, 17, 2**30, 2**30 + 1, I32 - 16, I32 - 15, I32 - 1, I32]


# Fuzz cases run this session, by kind; printed as `fuzz: N cases` in the terminal summary (CI log).
FUZZ_CASES: dict[str, int] = {}


def count_fuzz(kind: str, n: int = 1) -> None:
    FUZZ_CASES[kind] = FUZZ_CASES.get(kind, 0) + n


def pytest_terminal_summary(terminalreporter) -> None:
    if FUZZ_CASES:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(FUZZ_CASES.items()))
        terminalreporter.write_line(f"fuzz: {sum(FUZZ_CASES.values())} cases ({detail})")


# The Recorder's host ring (tests/engine) runs the snapshot kernel in Triton's interpreter on host memory: not where
# a GPU compiles it (there the CUDA tests cover the same ground with real launches).
hostring = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                              reason="interpreter-only (CPU); the CUDA tests cover this on a GPU")


_COMPILE = """
import importlib, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
fn = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
ann = fn.fn.__annotations__
sig = {a: "i32" if "int32" in str(ann.get(a, "")) else "i64" for a in fn.arg_names}
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": int(sys.argv[3])})
print(len(k.asm["ptx"]), len(k.asm["cubin"]))
"""


def compiled_for_a_gpu(module: str, kernel: str, warps: int, cache: Path) -> subprocess.CompletedProcess:
    """A Triton kernel of integer arguments (addresses and counts) compiled as a GPU compiles it (Triton's front end
    with the GPU's block sizes, then ptxas for sm_90) in a process without the interpreter, on any machine: stdout
    the PTX's and the cubin's sizes. The kernel tests run the interpreter's smaller blocks, so a shape that does not
    broadcast at the GPU's sizes passes them and fails only on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), TRITON_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", _COMPILE, module, kernel, str(warps)], env=env, capture_output=True,
                          text=True, timeout=300)
