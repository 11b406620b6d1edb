"""dump/ref.py: `FILE:I`, the one form every report names an observation by and `replay --obs` reads back."""

import os

import pytest

from dcptool.dump import match_file, obs_ref, parse_ref


@pytest.mark.parametrize("file,obs", [("run.safetensors", 0), ("run/x.rank3.safetensors", 1000),
                                      ("C:odd:name.safetensors", 127), ("with space.safetensors", 129)])
def test_a_reference_reads_back(file, obs):
    assert parse_ref(obs_ref(file, obs)) == (file, obs)


@pytest.mark.parametrize("spec,want", [("7", (None, 7)), (" 12", (None, 12)), ("a:b:3", ("a:b", 3))])
def test_parse(spec, want):
    assert parse_ref(spec) == want


@pytest.mark.parametrize("spec", ["", "x", "run.safetensors:", "run.safetensors:-1", "run:1.5", "run:٣", "1e3"])
def test_parse_refuses(spec):
    with pytest.raises(ValueError):
        parse_ref(spec)


def test_match_file_by_name_then_by_identity(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    (tmp_path / "link.safetensors").symlink_to(b)
    files = [str(a), str(b)]
    assert match_file(files, str(b)) == 1
    assert match_file(files, str(tmp_path / "link.safetensors")) == 1  # the same file under another name
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert match_file(files, "a.safetensors") == 0 and match_file(files, "./b.safetensors") == 1
    finally:
        os.chdir(here)
    assert match_file(files, str(tmp_path / "none.safetensors")) is None
