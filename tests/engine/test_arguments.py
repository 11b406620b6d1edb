"""observe()'s arguments on the host (arguments.py): integers are integers, anything else is dropped, never coerced;
site names are text without control characters."""

import unicodedata
import warnings

import numpy as np
import pytest
import torch

from dcptool.dump import Record, read_dump
from dcptool.engine.arguments import _CONTROL, check_vals, scalars
from dcptool.engine.recorder.record import Recorder


@pytest.mark.parametrize("bad", [dict(step=1.9), dict(rank="1"), dict(rank=1.0), dict(num_reqs=np.float64(1.0)),
                                 dict(num_reqs_padded=True), dict(ubatch=np.bool_(False)), dict(parent=0.5),
                                 dict(graph=2.0), dict(tok_start="0"), dict(buffer=1.5),
                                 dict(step=torch.tensor(1.0)), dict(num_reqs=torch.tensor([1]))])
def test_scalars_that_are_not_integers_are_dropped_not_coerced(tmp_path, bad):
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2)
    rec.observe(step=0, site="x", rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1)
    kw = dict(step=1, site="x", rank=1, seq_lens=[5], num_reqs=1, num_reqs_padded=1)
    with pytest.warns(RuntimeWarning, match="must be an integer"):
        assert rec.observe(**{**kw, **bad}) == -1
    assert rec.observe_many(**{**{k: v for k, v in kw.items() if k != "rank"}, "ranks": [0, "1"]}) == [-1, -1]
    assert rec.dropped == 3
    rec.close()
    assert read_dump(tmp_path / "r.safetensors")["obs.step"].tolist() == [0]


def test_numpy_and_host_tensor_integers_are_integers(tmp_path):
    """The must-not-trigger side: numpy integer scalars (any width) and 0-d integer host tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder(tmp_path / "r.safetensors", dcp_size=2) as rec:
            i = rec.observe(step=np.int64(2**40), site="x", rank=np.int32(1), seq_lens=[5, 0], num_reqs=np.uint8(1),
                            num_reqs_padded=torch.tensor(2), ubatch=np.int16(-1), graph=np.int8(3))
            rec.observe(step=1, site="x", rank=0, seq_lens=[5], num_reqs=1, num_reqs_padded=1, parent=np.int64(i),
                        tok_start=np.int32(0), buffer=np.uint64(7))
    d = read_dump(tmp_path / "r.safetensors")
    assert rec.dropped == 0 and d["obs.step"].tolist() == [2**40, 1] and d["obs.parent"].tolist() == [-1, 0]
    assert d["obs.rank"].tolist() == [1, 0] and d["obs.graph"].tolist() == [3, 0]


# --------------------------------------------------------------------------------------------
# Site names: text without control characters (they would forge lines in a log or drive a terminal)

@pytest.mark.parametrize("site", ["attn\nmetadata", "\x1b[31mred", "tab\there", "nul\x00", "del\x7f", "nel\x85",
                                  "\r", "\x9f"])
def test_a_site_name_with_a_control_character_is_refused(tmp_path, site):
    """observe() and observe_many() drop (count, warn about) an observation at a site holding a character of
    Unicode category Cc; the warning names the site by its repr and says what a site name may hold."""
    rec = Recorder(tmp_path / "c.safetensors", dcp_size=2)
    kw = dict(step=0, rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1)
    with pytest.warns(RuntimeWarning, match="control character") as w:
        assert rec.observe(site=site, **kw) == -1
    assert repr(site) in str(w[0].message) and "Unicode category Cc" in str(w[0].message)
    assert rec.observe_many(site=site, ranks=[0, 1], **{k: v for k, v in kw.items() if k != "rank"}) == [-1, -1]
    assert rec.dropped == 3 and site not in rec._site_ok
    assert rec.observe(site="attn_metadata", **kw) == 0
    rec.close()
    assert read_dump(tmp_path / "c.safetensors").config.sites == ("attn_metadata",)


def test_the_control_character_error_names_the_site_and_what_is_allowed():
    with pytest.raises(ValueError) as e:
        check_vals(scalars(Record(0, "a\nb", 0, 1, 1, None)), "a\nb", set())
    assert str(e.value) == ("site 'a\\nb' holds a control character: a site name is text without control "
                            "characters (Unicode category Cc: no newline, tab or escape)")


def test_printable_site_names_pass_and_are_remembered(tmp_path):
    """The must-not-trigger side: any printable Unicode (spaces, markup, other scripts, emoji, a no-break space
    and the line separator U+2028, which are not Cc) is recorded, and each name is checked once only (the fast
    path takes the names it remembers)."""
    names = ["attn_metadata", "a b", "[red]x[/red]", "ünïcødé 注意", "🙂", "no\u00a0break", "ls\u2028x", ""]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder(tmp_path / "p.safetensors", dcp_size=2) as rec:
            for i, site in enumerate(names):
                assert rec.observe(step=i, site=site, rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1) == i
            assert rec.observe_many(step=9, site="many", ranks=[0, 1], seq_lens=[3], num_reqs=1,
                                    num_reqs_padded=1) == [len(names), len(names) + 1]
    assert rec.dropped == 0 and rec._site_ok == {*names, "many"}
    assert read_dump(tmp_path / "p.safetensors").config.sites == (*names, "many")


def test_the_control_characters_are_exactly_unicode_category_cc():
    text = "".join(map(chr, range(0x110000)))
    assert {m.start() for m in _CONTROL.finditer(text)} == {
        c for c in range(0x110000) if unicodedata.category(chr(c)) == "Cc"}
