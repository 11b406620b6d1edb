"""The architecture the project promises (docs/architecture.md), checked: module and class sizes, tests that mirror
the packages, and what the engine side may load in the serving process."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "dcptool"
TESTS = ROOT / "tests"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
# No mirror of its own: the plugin's former address only forwards dcptool.engine.vllm's names (the plugin's tests
# are tests/engine/vllm/); checked by the import test below.
NO_MIRROR = {"dcptool/integrations/vllm.py"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_modules_and_classes_stay_small():
    """Modules <= 600 lines, classes <= 300 (end_lineno - lineno + 1, nested classes too): split by concept."""
    long_modules, long_classes = [], []
    for p in _modules():
        text = p.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            long_modules.append(f"{_rel(p)} ({n} lines)")
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes.append(f"{_rel(p)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long_modules and not long_classes, (f"modules over {MAX_MODULE_LINES} lines: {long_modules}; "
                                                   f"classes over {MAX_CLASS_LINES} lines: {long_classes}")


def mirror_of(module: Path) -> Path:
    """dcptool/<pkg>/<mod>.py -> tests/<pkg>/test_<mod>.py; dcptool/<mod>.py -> tests/test_<mod>.py."""
    parts = module.relative_to(PACKAGE).parts
    return TESTS.joinpath(*parts[:-1], f"test_{parts[-1]}")


def test_every_module_has_its_mirror_test_file():
    exempt = ("__init__.py", "__main__.py")
    missing = [f"{_rel(p)} -> {_rel(mirror_of(p))}" for p in _modules()
               if p.name not in exempt and _rel(p) not in NO_MIRROR and not mirror_of(p).exists()]
    assert not missing, f"modules without their test file: {missing}"


def _test_files() -> list[Path]:
    # tests/vllm is the vLLM-matrix suite, collected on its own (pyproject's norecursedirs)
    return [p for p in TESTS.rglob("test_*.py") if p.relative_to(TESTS).parts[0] != "vllm"]


def test_test_basenames_are_unique_and_test_directories_are_not_packages():
    """pytest's prepend import mode imports a test file by its basename: two test_x.py would collide."""
    seen: dict[str, list[str]] = {}
    for p in _test_files():
        seen.setdefault(p.name, []).append(_rel(p))
    assert not {k: v for k, v in seen.items() if len(v) > 1}
    inits = [_rel(p) for p in TESTS.rglob("__init__.py") if p.relative_to(TESTS).parts[0] != "vllm"]
    assert not inits, f"test directories must not be packages: {inits}"


def _fresh(script: str) -> dict:
    """`script` in a fresh Python (no GPU, the dcptool of this checkout): the JSON it printed last."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DCPTOOL_RECORD")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


OFFLINE = ("typer", "rich", "click", "dcptool.cli", "dcptool.check", "dcptool.report", "dcptool.diagnose",
           "dcptool.model")


def test_the_engine_and_the_format_load_nothing_of_the_offline_side():
    """Every module of dcptool.engine and dcptool.dump imported (the Triton kernel modules as the code loads them,
    through dcp.backend.load): none of the CLI, typer, rich or the offline packages is loaded."""
    got = _fresh(f"""
import importlib, json, pkgutil, sys
import dcptool.dump, dcptool.engine
from dcptool.dcp.backend import load
names = []
for pkg in (dcptool.dump, dcptool.engine):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        (load if m.name.endswith("_tl") else importlib.import_module)(m.name)
        names.append(m.name)
offline = {OFFLINE!r}
below = tuple(o + "." for o in offline)
loaded = sorted(m for m in sys.modules if m in offline or m.startswith(below))
print(json.dumps({{"imported": names, "offline": loaded}}))
""")
    assert {"dcptool.dump.schema", "dcptool.dump.write", "dcptool.engine.recorder.record",
            "dcptool.engine.snapshot.kernels_tl", "dcptool.engine.guard.device_checks_tl",
            "dcptool.engine.vllm"} <= set(got["imported"]), got["imported"]
    assert got["offline"] == []


def test_the_vllm_plugin_loads_light():
    """vLLM loads the plugin in every process: importing it (at its current and its former address) and calling
    register() without DCPTOOL_RECORD import neither torch nor triton, nor numpy (deferred to the first
    observation), nor anything of the offline side."""
    got = _fresh("""
import json, sys
import dcptool.engine.vllm as plugin
import dcptool.integrations.vllm as former
plugin.register()
print(json.dumps({"same": [getattr(former, n) is getattr(plugin, n) for n in ("register", "step", "close", "ENV_DIR")],
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in
                                   ("torch", "triton", "numpy", "safetensors", "typer", "rich", "click", "vllm")),
                  "dcptool": sorted(m for m in sys.modules if m.startswith("dcptool"))}))
""")
    assert got["same"] == [True] * 4
    assert got["loaded"] == []
    # only the plugin's own modules: the engine side's (its Recorder waits for the first observation)
    plugin_side = ("dcptool.engine.vllm", "dcptool.integrations")
    assert {"dcptool.engine.vllm", "dcptool.integrations.vllm"} <= set(got["dcptool"])
    assert all(m in ("dcptool", "dcptool.engine") or m.startswith(plugin_side) for m in got["dcptool"]), got["dcptool"]
