"""The vLLM plugin's hook tables (tables) against a fake vLLM: a table per release line, picked by version and
by signature, modules patched as imported or already loaded, and what happens when none fits."""

from conftest import cli
from vllm_cases import STEPS, run_case


def test_modules_loaded_before_register_are_patched_and_rebound(tmp_path):
    # default.py imported build_attn_metadata by name before the plugin ran: it must see the wrapper
    out = run_case(tmp_path, STEPS, before="import vllm.v1.worker.gpu.model_states.default\n")
    assert out["wrapped"] and out["dump"].n == 3


def test_unsupported_version_records_nothing_and_warns_once(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.28.0")  # older than every hook table
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1 and "0.28.0" in out["stderr"]
    out = run_case(tmp_path, STEPS, version="0.28.0", env={"DCPTOOL_VLLM_UNTESTED": "1"})
    assert out["dump"].n == 3


def test_a_newer_version_is_tried_with_the_newest_table_and_stops_on_a_mismatch(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.40.1")
    assert out["dump"].n == 3 and "disabled" not in out["stderr"]
    assert out["stderr"].count("newer than the releases this plugin knows") == 1
    assert set(out["used"].values()) == {"0.34"}
    out = run_case(tmp_path, STEPS, version="0.40.1", dcp_param="dcp_lengths")
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1


UBATCH = """
from vllm.v1.worker.gpu import ubatch_utils
out["ubatch_wrapped"] = bool(getattr(ubatch_utils.UBatchRunner.prepare, "__wrapped_by_dcptool__", False))
with plugin.step():
    out["results"].append(build(batch(), NONE))
"""


def test_each_release_line_gets_its_table(tmp_path):
    # 0.31 and 0.32 have 0.33's hooks (refused by the version check before)
    for version in ("0.31.0", "0.32.1", "0.33.0"):
        out = run_case(tmp_path, UBATCH, version=version)
        assert out["ubatch_wrapped"] and set(out["used"].values()) == {"0.31-0.33"}, version
    # 0.34: UBatchRunner.prepare takes batch_desc instead of cg_mode
    out = run_case(tmp_path, UBATCH, version="0.34.0", ubatch_mode="batch_desc, dp_sync_state=None")
    assert out["ubatch_wrapped"] and set(out["used"].values()) == {"0.34"} and "disabled" not in out["stderr"]
    assert out["dump"].config.engine_version == "0.34.0"
    # a prepare that no table knows: recording stops, once, and the engine runs on
    out = run_case(tmp_path, UBATCH, version="0.34.0", ubatch_mode="execution_mode")
    assert "UBatchRunner.prepare has no parameter batch_desc" in out["stderr"]
    assert not out["ubatch_wrapped"] and out["stderr"].count("dcptool: vLLM recording disabled") == 1
    assert out["files"] == [] and out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}]


def test_0_29_has_no_ubatch_idx_and_no_micro_batches(tmp_path):
    out = run_case(tmp_path, STEPS, version="0.29.0", ubatch_param="")
    assert "disabled" not in out["stderr"] and out["dump"].n == 3
    assert out["used"]["vllm.v1.worker.gpu.model_states.default"] == "0.29"
    c = out["dump"].config
    assert "ubatch" not in c.sites and "dummy" in c.sites
    assert "sites possible: attn_metadata, dummy" in c.note and "not possible: ubatch" in c.note
    # dcptool inspect shows it
    p = cli("inspect", *out["files"])
    assert p.returncode == 0 and "not possible: ubatch" in p.stdout
    # a 0.30+ recording says every site is possible
    assert "not possible" not in run_case(tmp_path, STEPS)["dump"].config.note


def test_a_version_string_that_lies_is_matched_by_signature(tmp_path):
    # a build that calls itself 0.33 but has 0.29's prepare_attn: the 0.29 table fits that module
    out = run_case(tmp_path, STEPS, version="0.33.0", ubatch_param="")
    assert "disabled" not in out["stderr"] and out["dump"].n == 3
    assert out["used"]["vllm.v1.worker.gpu.model_states.default"] == "0.29"


def test_other_internals_record_nothing_and_warn_once(tmp_path):
    out = run_case(tmp_path, STEPS, dcp_param="dcp_lengths")  # a renamed parameter
    assert out["files"] == [] and not out["wrapped"]
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1
    assert "build_attn_metadata has no parameter dcp_local_seq_lens" in out["stderr"]
    assert out["results"] == run_case(tmp_path, STEPS)["results"]  # the engine sees exactly what it would


def test_tables_for_each_version():
    from dcptool.engine.vllm.tables import TABLES, tables_for

    first = {v: [t.line for t in tables_for(v)][:1] for v in
             ("0.29.0", "0.29.3", "0.30.0", "0.31.1", "0.32.0", "0.33.0", "0.34.0", "0.34.2rc1", "0.35.0", "1.2.0",
              "0.28.0", "0.27.1", "dev", "")}
    assert first == {"0.29.0": ["0.29"], "0.29.3": ["0.29"], "0.30.0": ["0.30"], "0.31.1": ["0.31-0.33"],
                     "0.32.0": ["0.31-0.33"], "0.33.0": ["0.31-0.33"], "0.34.0": ["0.34"], "0.34.2rc1": ["0.34"],
                     "0.35.0": ["0.34"], "1.2.0": ["0.34"], "0.28.0": [], "0.27.1": [], "dev": [], "": []}
    assert [t.line for t in tables_for("0.35.0")] == ["0.34"]  # a newer release: the newest table only
    assert len(tables_for("0.33.0")) == len(TABLES)  # a known release: its own, then the others by signature
    assert [t.line for t in tables_for("0.28.0", untested=True)] == ["0.34", "0.31-0.33", "0.30", "0.29"]
    assert {"ubatch"} == set(TABLES[1].sites) - set(TABLES[0].sites)  # 0.29 cannot produce micro-batches
