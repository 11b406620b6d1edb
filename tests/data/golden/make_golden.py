"""Golden replay outputs (text, JSON Lines, HTML) of the samples and a few dumps built here, as replay wrote them
when it built one Finding object per finding: the columnar findings keep them byte for byte.

    python tests/data/golden/make_golden.py dumps     # (re)build the dumps this directory holds
    python tests/data/golden/make_golden.py outputs [DIR]  # (re)write golden.json (sha256 of each output) from
                                                           # the current code; DIR: also write the outputs there

tests/check/test_findings.py replays every dump here and in samples/ and compares byte for byte (seconds masked).
Regenerate the outputs only when a change to the findings themselves is intended (a new rule, a new message).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

SECONDS = [(re.compile(r'"seconds": [0-9.e-]+'), '"seconds": 0'),
           (re.compile(r"(backend \S+ on [^,\n<]+), [0-9.]+ s"), r"\1, 0 s"),
           (re.compile(r"(<dt>backend</dt><dd>\S+ on [^,<]+), [0-9.]+ s"), r"\1, 0 s")]


def mask(text: str) -> str:
    """Times differ from run to run: mask them."""
    for pat, rep in SECONDS:
        text = pat.sub(rep, text)
    return text


def dumps() -> list[Path]:
    """Every dump the golden outputs cover: the samples and the ones built here."""
    return sorted((ROOT / "samples").glob("*.safetensors")) + sorted(HERE.glob("*.safetensors"))


# (name, extra CLI arguments): each mode of every dump
MODES = (("json", ["--json"]), ("text", []), ("text-all", ["--max-findings", "3000"]), ("html", None),
         ("split-json", ["--split", "2", "--json"]), ("obs-text", ["--obs", "2"]))


def run_mode(path: Path, mode: str, args: list[str] | None, tmp: Path) -> str:
    from conftest import cli

    if args is None:  # the HTML page
        out = tmp / f"{path.stem}.html"
        out.unlink(missing_ok=True)
        r = cli("replay", str(path.relative_to(ROOT)), "--json", "--html", str(out), cwd=ROOT)
        assert r.returncode in (0, 1), r.stderr
        return mask(out.read_text())
    r = cli("replay", str(path.relative_to(ROOT)), *args, cwd=ROOT)
    assert r.returncode in (0, 1), (path, mode, r.stderr)
    return mask(r.stdout)


def build_dumps() -> None:
    from bench_provenance import make
    from bench_replay import make_dump
    from conftest import expected_view, obs, random_columns, write

    from dcptool.dump import DumpConfig, write_dump
    from dcptool.model.simulate import SimConfig, simulate

    make_dump(HERE / "bench-300.safetensors", 300, seed=3)
    make(HERE / "stale-300.safetensors", 300, "stale")
    make(HERE / "bucket-300.safetensors", 300, "one-bucket")
    rng = np.random.default_rng(16)
    write_dump(HERE / "random-120.safetensors", DumpConfig(dcp_size=4, cp_interleave=16, page_size=16,
                                                           sites=("attn_metadata",)), random_columns(rng, 120, 4, 16))
    seq = np.array([1000, 77, 35, 0], np.int32)
    a, b = np.array([300, 301, 0], np.int32), np.array([500, 9, 0], np.int32)
    o = [obs(step=0, seq=seq, num_reqs=3, view=[1000, 77, 35, 0]),
         obs(step=1, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 1)),
         obs(step=2, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=16)),
         obs(step=2, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=48)),
         obs(step=3, seq=a, num_reqs=2, num_reqs_padded=3), obs(step=4, seq=b, num_reqs=2, num_reqs_padded=3),
         obs(step=5, seq=b, num_reqs=2, num_reqs_padded=3, view=expected_view(a, 2, 3, 2, 0)),
         obs(step=6, site="a b\x1b[31m", seq=[16, 16, 0], num_reqs=2, num_reqs_padded=3),
         obs(step=6, site="<b>", seq=[8, 8, 0], num_reqs=2, num_reqs_padded=3, view=[8, 8, 0]),
         obs(step=7, seq=[9, 9, 0], num_reqs=2, num_reqs_padded=3, view=[5, 5, 7, 1]),
         obs(step=8, seq=[9, 9, 0], num_reqs=2, num_reqs_padded=3, view=None)]
    write(HERE / "values.safetensors", o, page_size=48)
    write(HERE / "stray.safetensors", [obs(step=i, dcp=1) for i in range(3)], dcp=1)
    tmp = HERE / "_sim.safetensors"
    simulate(SimConfig(dcp=8, steps=10, pipeline="legacy", seed=5, max_num_reqs=16, token_budget=512), tmp)
    tmp.replace(HERE / "legacy-dcp8.safetensors")


def outputs(tmp: Path) -> dict[str, str]:
    """Every (dump, mode) output of the current code, masked: {"<dump>.<mode>": text}."""
    return {f"{p.stem}.{mode}": run_mode(p, mode, args, tmp) for p in dumps() for mode, args in MODES}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def write_outputs(keep: str | None = None) -> None:
    """golden.json: the sha256 of each output (the outputs themselves are 8 MB); `keep`: a directory to also
    write the outputs to, to diff against when a comparison fails."""
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        out = outputs(Path(t))
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for k, v in out.items():
            (Path(keep) / k).write_text(v, errors="surrogateescape")
    (HERE / "golden.json").write_text(json.dumps({k: digest(v) for k, v in out.items()}, indent=0, sort_keys=True)
                                      + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "dumps":
        build_dumps()
    else:
        write_outputs(sys.argv[2] if len(sys.argv) > 2 else None)
