"""A Recorder's settings (settings.py): its documented keywords split into what it records (DumpConfig) and how
(Options), a whole config= or options= taken as they are, an unknown keyword a TypeError, a bad setting a
ValueError."""

import pytest

from dcptool.dump import DumpConfig, KVGroup
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.recorder.settings import Options, settings


def test_the_keywords_are_the_configs_and_the_options():
    cfg, opts = settings(4, 2, None, None, dict(sites=["a"], page_size=16, rollover=10, force=True, note="n",
                                                kv_groups=[{"name": "attn", "dcp": True}], max_bytes=99))
    assert cfg == DumpConfig(dcp_size=4, cp_interleave=2, sites=("a",), page_size=16, note="n",
                             kv_groups=(KVGroup("attn", True),))
    assert opts == Options(rollover=10, force=True, max_bytes=99)
    cfg2, opts2 = settings(None, 1, cfg, opts, dict(note="m", ring_full="drop"))
    assert cfg2 == DumpConfig(**{**cfg.__dict__, "note": "m"}) and opts2 == Options(10, True, max_bytes=99,
                                                                                   ring_full="drop")


@pytest.mark.parametrize("kw, match", [(dict(roll_over=3), "unexpected keyword argument 'roll_over'"),
                                       (dict(dcp_size=2), "multiple values for argument 'dcp_size'")])
def test_an_unknown_keyword_is_a_type_error(tmp_path, kw, match):
    with pytest.raises(TypeError, match=match):
        Recorder(tmp_path / "r.safetensors", 2, **kw)
    with pytest.raises(TypeError, match="dcp_size"):
        Recorder(tmp_path / "r.safetensors")
    with pytest.raises(TypeError, match="config="):
        Recorder(tmp_path / "r.safetensors", 2, config=DumpConfig(dcp_size=2))


@pytest.mark.parametrize("kw, match", [(dict(rollover=0), "rollover"), (dict(cuda_mode="fast"), "cuda_mode"),
                                       (dict(max_bytes=0), "max_bytes"), (dict(max_bytes=1.5), "max_bytes"),
                                       (dict(ring_full="block"), "ring_full")])
def test_a_bad_setting_is_a_value_error(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        Recorder(tmp_path / "r.safetensors", 2, **kw)
    assert not (tmp_path / "r.safetensors").exists()


def test_a_recorder_from_a_config_and_options_records_as_one_from_keywords(tmp_path):
    cfg, opts = DumpConfig(dcp_size=2, sites=("a",), page_size=16), Options(rollover=2)
    a = Recorder(tmp_path / "a.safetensors", config=cfg, options=opts)
    b = Recorder(tmp_path / "b.safetensors", 2, sites=("a",), page_size=16, rollover=2)
    assert a.config == b.config and a.rollover == b.rollover == 2
    for r in (a, b):
        for i in range(3):
            r.observe(step=i, site="a", rank=0, seq_lens=[i + 1], num_reqs=1, num_reqs_padded=1, kv_pages=[1])
    assert [f.name for f in a.close()] == [f.name.replace("b.", "a.") for f in b.close()]
