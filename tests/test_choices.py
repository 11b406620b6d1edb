"""choices.py: the enumerated options, as --help lists them and as a refusal names them."""

import pytest
from conftest import cli

from dcptool.choices import Backend, CudaGraph, Pipeline, SpecMethod, metavar, spoken, values


def test_values_metavar_spoken():
    assert values(Backend) == ("auto", "triton", "torch")
    assert metavar(CudaGraph) == "[none|piecewise|full]" and spoken(CudaGraph) == "none, piecewise or full"
    assert spoken(Pipeline) == "fixed or legacy" and spoken(SpecMethod) == "mtp or dflash"


@pytest.mark.parametrize("cmd,option,enum", [("replay", "--backend", Backend), ("simulate", "--cudagraph", CudaGraph),
                                             ("simulate", "--pipeline", Pipeline),
                                             ("simulate", "--spec-method", SpecMethod)])
def test_help_shows_the_choices_and_a_bad_one_is_one_line(cmd, option, enum):
    h = cli(cmd, "--help", env={"COLUMNS": "200"})
    assert f"{option} {metavar(enum)}" in h.stdout
    r = cli(cmd, option, "bogus", *(["x.safetensors"] if cmd == "replay" else ["--steps", "1"]))
    assert r.returncode == 2 and r.stderr == f"dcptool {cmd}: {option}: 'bogus': choose {spoken(enum)}\n"
