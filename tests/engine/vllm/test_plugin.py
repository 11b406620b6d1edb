"""The vLLM plugin's entry (dcptool.engine.vllm) against a fake vLLM: register's gating, step scopes, a dump that
replays clean, and the plugin's former address."""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import EntryPoint

import numpy as np
from conftest import ROOT, cli
from vllm_cases import STEPS, run_case


def test_records_each_build_with_its_batch(tmp_path):
    out = run_case(tmp_path, STEPS)
    assert out["wrapped"] and out["finder"]
    assert out["results"] == [{"num_reqs": 4, "dcp": [9, 13, 0, 0]}, {"num_reqs": 2, "dcp": [9, 13]},
                              {"num_reqs": 2, "dcp": None}]  # the engine's results, untouched
    d = out["dump"]
    assert [os.path.basename(f) for f in d.files] == ["rank0.00000.safetensors"]
    assert d.config.dcp_size == 2 and d.config.cp_interleave == 1 and d.config.engine == "vllm"
    assert d["obs.step"].tolist() == [0, 0, 1]  # one step scope, then a build on its own
    assert d["obs.num_reqs"].tolist() == [2, 2, 2] and d["obs.num_reqs_padded"].tolist() == [4, 4, 4]
    assert d["obs.graph"].tolist() == [3, 0, 0]  # FULL at runtime = a full-graph replay
    assert d["obs.has_dcp"].tolist() == [1, 1, 0]
    assert d.dcp_of(0).tolist() == [9, 13, 0, 0] and d.dcp_of(1).tolist() == [9, 13, 0, 0]  # the view as passed
    assert d.qsl_of(0).tolist() == [0, 1, 2, 2, 2] and d["obs.num_tokens_padded"].tolist() == [4, 4, 4]
    assert {d.site_name(i) for i in range(d.n)} == {"attn_metadata"}


def test_nothing_happens_without_the_variable(tmp_path):
    out = run_case(tmp_path, STEPS, env={"DCPTOOL_RECORD": ""})
    assert out["other_finder"]  # the driver's own `Finder` (as virtualenv's): not taken for the plugin's
    assert not out["wrapped"] and not out["finder"] and out["files"] == []
    assert out["results"][0] == {"num_reqs": 4, "dcp": [9, 13, 0, 0]}
    assert not (tmp_path / "rec").exists()


def test_recorded_dump_replays_clean(tmp_path):
    n = 3
    body = f"""
    for _ in range({n}):
        with plugin.step():
            build(batch(), FULL)
    """
    out = run_case(tmp_path, body)
    p = cli("replay", "--backend", "torch", *out["files"], "--json")
    summary = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and summary["observations"] == n and summary["findings"] == 0
    assert np.array_equal(out["dump"]["obs.step"], np.arange(n))


def test_the_former_address_loads_the_same_plugin():
    """vLLM configurations naming `dcptool.integrations.vllm:register` (the plugin's former home) keep loading it:
    vLLM's plugin loader (vllm.plugins.load_plugins_by_group) calls EntryPoint.load() on each `vllm.general_plugins`
    entry point, by the value string, in a fresh process."""
    import dcptool.integrations.vllm as former
    from dcptool.engine import vllm as plugin

    assert former.register is plugin.register and former.step is plugin.step and former.close is plugin.close
    assert former.ENV_DIR == plugin.ENV_DIR == "DCPTOOL_RECORD"
    section = (ROOT / "pyproject.toml").read_text().split('[project.entry-points."vllm.general_plugins"]\n', 1)[1]
    value = re.match(r'dcptool = "([^"]+)"', section)[1]
    assert value == "dcptool.engine.vllm:register"
    for name in (value, "dcptool.integrations.vllm:register"):
        assert EntryPoint(name="dcptool", value=name, group="vllm.general_plugins").load() is plugin.register
    # a worker process that only knows the former name: it imports and registers nothing without DCPTOOL_RECORD
    script = ("from importlib.metadata import EntryPoint\n"
              "f = EntryPoint(name='dcptool', value='dcptool.integrations.vllm:register', group='vllm.general_plugins')"
              ".load()\nimport dcptool.engine.vllm as p\nassert f is p.register\nf()\nassert not p.STATE.registered\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
