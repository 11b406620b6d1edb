"""inputs.py: every command takes its dumps alike (files, directories, quoted globs, comma-separated lists), writes
under one no-overwrite rule, and refuses option values in dcptool's words."""

import json
import os

import pytest
import typer
from conftest import cli, obs, write

from dcptool.errors import UsageError
from dcptool.inputs import InputError, dump_paths, integer, number, output_target


@pytest.fixture
def run(tmp_path):
    """A run of 11 rank files (rank10 after rank2: natural order) in run/, and a file beside it."""
    d = tmp_path / "run"
    d.mkdir()
    files = [write(d / f"x.rank{r}.safetensors", [obs(step=s, rank=r, dcp=11) for s in range(3)], dcp=11)
             for r in range(11)]
    (d / "notes.txt").write_text("not a dump")
    return d, files


def test_files_directories_globs_and_lists(run, tmp_path):
    d, files = run
    assert dump_paths([str(d)]) == files  # a directory: its *.safetensors, in natural order
    assert dump_paths([str(d / "x.rank*.safetensors")]) == files  # a quoted glob, the same order
    assert dump_paths([files[3], files[1]]) == [files[3], files[1]]  # files: as given
    assert dump_paths([f"{files[0]},{d / 'x.rank1?.safetensors'}"]) == [files[0], files[10]]
    odd = tmp_path / "a,b.safetensors"  # a path that exists is taken whole, commas and all
    odd.write_bytes(b"")
    assert dump_paths([str(odd)]) == [str(odd)]
    assert dump_paths([str(tmp_path / "missing.safetensors")]) == [str(tmp_path / "missing.safetensors")]


@pytest.mark.parametrize("spec,needle", [("none*.safetensors", "no file matches"), ("EMPTY", "holds no *.safetensors"),
                                         (",", "no dump named")])
def test_nothing_to_read_is_one_line(tmp_path, spec, needle):
    (tmp_path / "EMPTY").mkdir()
    with pytest.raises(InputError, match=needle.replace("*", r"\*")):
        dump_paths([spec if spec == "," else str(tmp_path / spec)])


@pytest.mark.parametrize("command", ["replay", "inspect", "diff", "reduce", "export-test"])
@pytest.mark.parametrize("form", ["files", "directory", "glob", "list"])
def test_every_command_takes_dumps_alike(run, tmp_path, command, form):
    d, files = run
    arg = {"files": files, "directory": [str(d)], "glob": [str(d / "*.safetensors")], "list": [",".join(files)]}[form]
    extra = {"replay": ["--json"], "inspect": ["--json"], "diff": [], "reduce": ["--finding", "missing", "-o",
             str(tmp_path / "o.safetensors")], "export-test": ["-o", str(tmp_path / "o.py")]}[command]
    if command == "diff":
        if form == "files":
            pytest.skip("diff takes one argument a run: a list, a directory or a glob")
        r = cli("diff", arg[0], arg[0])
        assert r.returncode == 0 and f"{len(files) * 3} aligned" in r.stdout, r.stderr
        return
    r = cli(command, *arg, *extra)
    if command in ("reduce", "export-test"):  # a clean run: nothing to reduce or export, said about the run read
        assert r.returncode == 2 and "Traceback" not in r.stderr and "no missing finding" in r.stderr or \
            "nothing to export" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out.get("observations", out.get("files") and out["observations"]) == 3 * len(files)


def test_output_target_rule(tmp_path):
    dump = write(tmp_path / "d.safetensors", [obs()])
    out = tmp_path / "o.html"
    output_target("--html", out, [dump], False)  # absent: fine
    out.write_text("x")
    with pytest.raises(UsageError, match="exists \\(use --force to overwrite\\)"):
        output_target("--html", out, [dump], False)
    output_target("--html", out, [dump], True)
    with pytest.raises(UsageError, match="is one of the dumps read"):
        output_target("-o", tmp_path / "d.safetensors", [dump], True)
    with pytest.raises(UsageError, match="does not exist"):
        output_target("-o", tmp_path / "no" / "o.html", [], True)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="not a regular file") as e:
        output_target("-o", tmp_path / "fifo", [], True)
    assert e.value.option == "-o"


@pytest.mark.parametrize("lo,hi,text,want", [(0, None, "0", 0), (1, None, " 7 ", 7), (1, 64, "64", 64),
                                             (0, None, "-1", "must be >= 0, got -1"),
                                             (1, 64, "65", "must be from 1 to 64, got 65"),
                                             (1, None, "x", "expected an integer >= 1, got 'x'"),
                                             (1, None, "1.5", "expected an integer >= 1, got '1.5'")])
def test_integer(lo, hi, text, want):
    if isinstance(want, int):
        assert integer(lo, hi)(text) == want
    else:
        with pytest.raises(typer.BadParameter, match=want.replace("(", r"\(").replace(")", r"\)")):
            integer(lo, hi)(text)


@pytest.mark.parametrize("text,ok", [("0.1", True), ("60", True), ("0", False), ("nan", False), ("inf", False),
                                     ("x", False)])
def test_number(text, ok):
    if ok:
        assert number(0.1)(text) == float(text)
    else:
        with pytest.raises(typer.BadParameter):
            number(0.1)(text)


@pytest.mark.parametrize("args", [["replay", "D", "--html", "O"], ["diff", "D", "D", "--html", "O"],
                                  ["simulate", "--steps", "1", "-o", "O"], ["export-test", "D", "-o", "O"],
                                  ["reduce", "D", "--finding", "missing", "-o", "O"]])
def test_one_force_and_one_rule_for_every_output(tmp_path, args):
    dump = write(tmp_path / "d.safetensors", [obs(view=None)])
    out = tmp_path / "o"
    out.write_text("keep")
    args = [{"D": dump, "O": str(out)}.get(a, a) for a in args]
    r = cli(*args)
    option = "--html" if "--html" in args else "-o"
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == (f"dcptool {args[0]}: {option}: {out}: exists (use "
                                                                 "--force to overwrite)\n")
    assert out.read_text() == "keep"
    r = cli(*args, "--force")
    assert r.returncode in (0, 1) and out.read_bytes() != b"keep", r.stderr
    assert r.stderr.startswith(f"dcptool: wrote {out}")  # the status line: stderr, every command
    assert "wrote" not in r.stdout
    assert cli(*args, "--no-force").returncode == 2  # one spelling: no --no-force
