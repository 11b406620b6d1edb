"""The README and docs/ as a newcomer uses them: every shell example runs and prints what the page shows, and every
file, link, section, option, make target and module a page names exists (tests/docs_examples.py runs the examples).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import tomllib
from docs_examples import (
    PYTHON_RUN_ELSEWHERE,
    ROOT,
    Command,
    check_command,
    console_blocks,
    examples,
    lines_match,
    pages,
    parse_console,
    run_page,
    tokens,
    user_env,
)

PAGES = pages()
REL = {p: p.relative_to(ROOT).as_posix() for p in PAGES}


def _ids(paths):
    return [REL[p] for p in paths]


# ---- the examples


WITH_EXAMPLES = [p for p in PAGES if examples(p)]


@pytest.mark.parametrize("page", WITH_EXAMPLES, ids=_ids(WITH_EXAMPLES))
def test_examples_print_what_the_page_shows(page, tmp_path):
    scratch = tmp_path / "work"
    scratch.mkdir()
    failures = run_page(page, scratch)
    assert not failures, f"{len(failures)} example(s) of {REL[page]} differ:\n\n" + "\n\n".join(failures)


def test_python_examples_left_to_other_tests_are_run_there():
    for page, test in PYTHON_RUN_ELSEWHERE.items():
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test
        assert (ROOT / page).exists(), page


def test_the_readme_walks_through_the_commands():
    """The README's walk runs the commands a newcomer needs, as tested examples (not as untested text)."""
    cmds = [c.text for b in console_blocks(ROOT / "README.md") for c in b.commands]
    for needed in ("dcptool simulate", "dcptool replay", "--obs", "dcptool diff"):
        assert any(needed in c for c in cmds), needed


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_shell_prompts_only_in_tested_blocks(page):
    """A `$ ` prompt promises output a user can check: such blocks are ```console blocks, which run."""
    for t in tokens(page):
        if t.type in ("fence", "code_block") and re.search(r"^\$ ", t.content, re.M):
            assert t.type == "fence" and t.info.split()[:1] == ["console"], \
                f"{REL[page]}:{t.map[0] + 1}: a block with `$ ` prompts must be a ```console block"


# ---- the runner itself: what it must catch and what it must let through


@pytest.mark.parametrize("expected, actual, ok", [
    (["a", "b"], ["a", "b"], True),
    (["a", "b"], ["a", "c"], False),
    (["a"], ["a", "b"], False),  # a line printed and not shown
    (["a", "b"], ["a"], False),
    (["a", "...", "z"], ["a", "z"], True),  # ... is any lines, none included
    (["a", "...", "z"], ["a", "b", "c", "z"], True),
    (["a", "...", "z"], ["a", "b", "c"], False),
    (["...", "x", "...", "x"], ["x", "y", "x", "x"], True),  # backtracking
    (["...", "y", "x"], ["x", "y", "x", "y"], False),
    (["..."], [], True),
    ([], [], True),
    (["first at obs ... (step 0)"], ["first at obs 297 (step 0)"], True),  # ... inside a line
    (["first at obs ... (step 0)"], ["first at obs 297 (step 1)"], False),
    (["backend torch on cpu, 0.12 s"], ["backend torch on cpu, 3.40 s"], True),  # timings are any number
    (["backend torch on cpu, 0.12 s"], ["backend torch on gpu, 0.12 s"], False),
    (["1 passed in 3.68s"], ["1 passed in 12s"], True),
    (["1 passed in 3.68s"], ["2 passed in 3.68s"], False),
    (["a.b (x)"], ["aXb (x)"], False),  # the shown text is literal, not a regular expression
])
def test_lines_match(expected, actual, ok):
    assert lines_match(expected, actual) is ok


def test_parse_console_reads_commands_outputs_and_exit_codes():
    block = "$ dcptool replay a \\\n>   --json\nline 1\n...\n[exit 1]\n$ echo hi\nhi\n"
    cmds = parse_console(block, 10, "page.md")
    assert [(c.line, c.text, c.expected, c.exit) for c in cmds] == [
        (10, "dcptool replay a \\\n  --json", ["line 1", "..."], 1), (15, "echo hi", ["hi"], 0)]
    with pytest.raises(ValueError, match="page.md:10: output before"):
        parse_console("hello\n$ ls\n", 10, "page.md")
    with pytest.raises(ValueError, match="must be the last line"):
        parse_console("$ false\n[exit 1]\nmore\n", 1, "page.md")


@pytest.mark.parametrize("text, expected, exit, ok", [
    ("printf 'a\\nb\\n'", ["a", "b"], 0, True),
    ("printf 'a\\nb\\n'", ["a", "c"], 0, False),
    ("echo no >&2; exit 3", ["no"], 3, True),  # stderr shows on the terminal, in order
    ("pwd", ["."], 0, True),  # the scratch directory's path is shown as .
    ("echo no >&2; exit 3", ["no"], 0, False),  # an exit code not shown fails
    ("exit 0", [], 2, False),
    ("test -t 1 && echo terminal", ["terminal"], 0, True),  # run as on a user's terminal
    ("tput cols 2>/dev/null || stty size | cut -d' ' -f2", ["100"], 0, True),
    ("printf 'working\\r\\033[2Kdone\\n'", ["done"], 0, True),  # a line redrawn (a progress bar): what shows
])
def test_check_command(tmp_path, text, expected, exit, ok):
    assert (check_command(Command(1, text, expected, exit), "page.md", tmp_path, user_env()) is None) is ok


# ---- what the pages name exists


def _slug(text: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _headings(page: Path) -> set[str]:
    toks = tokens(page)
    out, seen = set(), {}
    for i, t in enumerate(toks):
        if t.type == "heading_open":
            text = "".join(c.content for c in toks[i + 1].children if c.type in ("text", "code_inline"))
            slug = _slug(text)
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out |= {text.lower(), slug if n == 0 else f"{slug}-{n}"}
    return out


def _inline(page: Path):
    for t in tokens(page):
        for c in t.children or ():
            yield t.map[0] + 1 if t.map else 0, c


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_links_resolve(page):
    """Every relative link names a file of the repository, and its #anchor a heading there."""
    bad = []
    for line, c in _inline(page):
        if c.type != "link_open":
            continue
        href = c.attrs["href"]
        if re.match(r"[a-z]+:", href):
            continue
        path, _, anchor = href.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{REL[page]}:{line}: {href}: no such file")
        elif anchor and (target.suffix != ".md" or anchor not in _headings(target)):
            bad.append(f"{REL[page]}:{line}: {href}: no such section")
    assert not bad, "\n".join(bad)


REPO_PATH = re.compile(r"(?:\./)?((?:dcptool|docs|tests|benchmarks|tools|samples|\.ci)(?:/[\w.-]+)*/?)(?:::(\w+))?")


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_files_exist(page):
    """Every repository path a page names in `code` (a file, a directory, a test by FILE::NAME) exists."""
    bad = []
    for line, c in _inline(page):
        m = REPO_PATH.fullmatch(c.content) if c.type == "code_inline" else None
        if not m or "/" not in m[1]:
            continue
        path = ROOT / m[1]
        if not path.exists():
            bad.append(f"{REL[page]}:{line}: {m[1]}: no such file or directory")
        elif m[2] and not re.search(rf"^\s*(?:async )?def {m[2]}\(|^class {m[2]}\b", path.read_text(), re.M):
            bad.append(f"{REL[page]}:{line}: {m[0]}: no such test")
    assert not bad, "\n".join(bad)


def _shell_text(page: Path):
    """(line, text) of every code span and every code block but Python's: where a page shows commands."""
    for t in tokens(page):
        if t.type == "code_block" or (t.type == "fence" and t.info.split()[:1] not in (["python"], ["py"])):
            yield t.map[0] + 1, t.content, True
        for c in t.children or ():
            if c.type == "code_inline":
                yield (t.map[0] + 1 if t.map else 0), c.content, False


def _options(command):
    import typer

    ctx = typer.Context(command)
    return {o for p in command.get_params(ctx) for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_commands_and_options_exist(page):
    """Every `dcptool COMMAND --option` a page shows (examples, synopses, code spans) is one the CLI has."""
    from typer.main import get_command

    from dcptool.cli import app

    group = get_command(app)
    bad = []
    for line, text, block in _shell_text(page):
        # a command: dcptool starting a code span, or a block's line (after a prompt), or after a pipe or &&
        start = r"(?:^|\|\s*|&&\s*)(?:\$ )?" if block else r"\A"
        for m in re.finditer(start + r"dcptool((?:[ \t]+--[\w-]+)*)[ \t]+([a-z][\w-]*)([^\n|;&`)]*)", text, re.M):
            opts, name, rest = m[1].split(), m[2], m[3]
            if name not in group.commands:
                if not (m[1] == "" and re.match(r"[A-Z]|COMMAND", name)):
                    bad.append(f"{REL[page]}:{line}: dcptool {name}: no such command")
                continue
            bad += [f"{REL[page]}:{line}: dcptool {o}: no such option" for o in opts if o not in _options(group)]
            known = _options(group.commands[name])
            for tok in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest):
                if tok not in known:
                    bad.append(f"{REL[page]}:{line}: dcptool {name} {tok}: no such option")
    assert not bad, "\n".join(sorted(set(bad)))


MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_make_targets_exist(page):
    bad = [f"{REL[page]}:{line}: make {t}: no such target" for line, text, _ in _shell_text(page)
           for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", text) if t not in MAKE_TARGETS]
    assert not bad, "\n".join(bad)


SOURCES = "\n".join(f.read_text(encoding="utf-8") for d in ("dcptool", "tests") for f in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_environment_variables_exist(page):
    """Every DCPTOOL_* variable a page names is one the code reads (or the tests set)."""
    names = set(re.findall(r"\bDCPTOOL_[A-Z_]*[A-Z]\b", page.read_text(encoding="utf-8")))
    missing = sorted(n for n in names if n not in SOURCES)
    assert not missing, f"{REL[page]} names {missing}, which nothing reads"

METADATA_KEYS = {"dcptool.format", "dcptool.config", "dcptool.injected", "dcptool.capped"}  # docs/format.md


def _resolves(name: str) -> bool:
    module, _, attr = name.partition(":")
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in [*parts[i:], *([attr] if attr else [])]:
                obj = getattr(obj, a)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_named_modules_exist(page):
    """Every `dcptool.module[.name]` a page names in code imports (a renamed module fails here)."""
    bad = []
    for line, c in _inline(page):
        if c.type == "code_inline" and re.fullmatch(r"dcptool(\.\w+)+(:\w+)?", c.content) \
                and c.content not in METADATA_KEYS and not _resolves(c.content):
            bad.append(f"{REL[page]}:{line}: {c.content}: does not import")
    assert not bad, "\n".join(bad)


# A section named from code or configuration: `README: Exit codes`, `(README "Supported versions")`; a passage of
# a page, quoted: `docs/performance.md "The progress bar"`.
SECTION_REF = re.compile(r"README(?:,? \"([^\"]+)\"|: ([A-Z][\w' -]*\w))|(docs/[\w-]+\.md),? \"([^\"]+)\"")


def test_sections_named_in_the_code_exist():
    files = [f for d in ("dcptool", "tests", "benchmarks", "tools") for f in (ROOT / d).rglob("*.py")]
    files += [ROOT / "pyproject.toml", ROOT / "Makefile", ROOT / ".ci" / "run", *(ROOT / "tools").glob("*.sh")]
    readme = _headings(ROOT / "README.md")
    bad = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in SECTION_REF.finditer(line):
                if m[3]:  # a quoted passage of a page: its words are there
                    page = ROOT / m[3]
                    ok = page.exists() and m[4].lower() in page.read_text(encoding="utf-8").lower()
                else:
                    ok = (m[1] or m[2]).lower() in readme
                if not ok:
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {m[0]}: no such section")
    assert not bad, "\n".join(bad)


# What is not in the repository: the design contract dcptool started from (its sections: the docs hold them now),
# private notes, the development machine's shared directory
OUTSIDE = re.compile(r"\bDESIGN\b|\.\./shared|/work/|vllm-dcp-notes|\bnotes \d")


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_pages_point_only_inside_the_repository(page):
    """The repository stands alone: no page sends a reader to a file outside it."""
    m = OUTSIDE.search(page.read_text(encoding="utf-8"))
    assert m is None, f"{REL[page]} names {m[0]!r}, which is not in the repository"


STANDALONE = ("dcptool", "tests", "samples", "tools", "benchmarks")


def test_code_tests_and_samples_point_only_inside_the_repository():
    """Nor does the code (its comments, the test files export-test writes, known_bugs.json's sources), the tests,
    the samples (their notes, inside the dump files) or the tools: each cites the docs page or the public vLLM
    reference that holds what it relies on."""
    bad = []
    for top in STANDALONE:
        for f in sorted((ROOT / top).rglob("*")):
            if not f.is_file() or "__pycache__" in f.parts or f == Path(__file__).resolve():
                continue
            for n, line in enumerate(f.read_bytes().decode("latin-1").splitlines(), 1):
                m = OUTSIDE.search(line)
                if m:
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {m[0]!r}")
    assert not bad, "\n".join(bad)


# ---- tables that must say what the code does


def test_the_rule_table_is_the_code_s():
    """docs/replay.md lists every rule replay checks, in the order findings of one observation come, with its
    severity, its letter in the timeline and what it catches (the row's `what`: one text, two readers)."""
    from dcptool.dcp.rules import TABLE

    text = (ROOT / "docs" / "replay.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z-]+)` \| (error|warning) \| `(\w)` \| (.+?) \|[^|]*\|$", text, re.M)
    assert rows == [(r.name, r.severity, r.code, r.what) for r in TABLE]


def _section(page: Path, heading: str) -> str:
    """The text under a heading, up to the next heading of its level or above."""
    text = page.read_text(encoding="utf-8")
    m = re.search(rf"^(#+) {re.escape(heading)}$", text, re.M)
    assert m, f"{page.name}: no section {heading!r}"
    end = re.compile(rf"^#{{1,{len(m[1])}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def test_supported_versions_are_what_is_tested():
    """The README's floors are pyproject.toml's, the oldest numpy `make test-oldest` installs, the torch the
    Makefile installs, and the vLLM releases of `make test-vllm`'s matrix."""
    section = _section(ROOT / "README.md", "Supported versions")
    rows = {m[0].split(" (")[0].strip("` "): m[1] for m in re.findall(r"^\| ([^|]+) \| (.*)\|$", section, re.M)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {"Python": project["requires-python"].removeprefix(">=")}
    for dep in project["dependencies"]:
        m = re.match(r"([\w-]+)>=([\d.]+)", dep)
        floors[m[1]] = m[2]
    make = (ROOT / "Makefile").read_text()
    for name, floor in floors.items():
        assert name in rows and f"≥ {floor}" in rows[name].split("|")[0], (name, floor, rows.get(name))
    assert re.search(r"NUMPY_OLDEST \?= ([\d.]+)", make)[1] in rows["numpy"]
    assert re.search(r"torch==([\d.]+)", make)[1] in rows["torch"]
    vllm = re.search(r"VLLM_VERSIONS \?= (.+)", make)[1].split()
    assert vllm and all(v in rows["vLLM"] for v in vllm), rows.get("vLLM")

