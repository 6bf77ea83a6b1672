"""The docs cannot rot: every Python block of the README runs as written (alone or under
torchrun, as the HTML comment before it says), every link and file reference in the README and
docs/ points to something in the repository (anchors included), docs/ARCHITECTURE.md's table
names every AXONN_C_* setting the code reads and equals the C table of them (csrc/core/env.c),
and the package's torch requirement keeps an installed torch."""
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
NOT_IN_REPO = {"build", ".venv", ".git", ".pytest_cache", "gpu_out", "__pycache__"}
TOP_DIRS = {p.name for p in ROOT.iterdir()
            if p.is_dir() and p.name not in NOT_IN_REPO and not p.name.endswith(".egg-info")}
MARKER = re.compile(r"<!--\s*docs-test:\s*(python|torchrun (\d+))\s*-->")


def readme_python_blocks():
    """(line, how, ranks, code) of every ```python block of the README; how is None when the
    block has no docs-test marker on the line before it."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        m = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        how = None if not m else ("torchrun" if m.group(2) else "python")
        blocks.append((i + 1, how, int(m.group(2)) if m and m.group(2) else 1,
                       "\n".join(lines[i + 1:end]) + "\n"))
    return blocks


BLOCKS = readme_python_blocks()


def test_every_readme_python_block_says_how_it_runs():
    unmarked = [line for line, how, _, _ in BLOCKS if how is None]
    assert not unmarked, (f"README.md python blocks at lines {unmarked} need a marker line "
                          "before them: <!-- docs-test: python --> or "
                          "<!-- docs-test: torchrun N -->")
    assert len(BLOCKS) >= 2


@pytest.mark.multiproc
@pytest.mark.parametrize("line,how,ranks,code", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_python_block_runs(line, how, ranks, code, tmp_path):
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code, encoding="utf-8")
    if how == "torchrun":
        torchrun(ranks, script, timeout=600)  # (fails the test with the ranks' output)
    else:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=600, cwd=tmp_path)
        assert r.returncode == 0, f"README.md line {line}:\n{r.stdout}\n{r.stderr}"


def slug(heading):
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path):
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_target(base: Path, target: str):
    """Why `target` (a link target relative to `base`, maybe with #anchor) is broken, or None."""
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve()
    if not dest.exists():
        return "no such file"
    if ROOT.resolve() not in dest.parents and dest != ROOT.resolve():
        return "outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor}"
    return None


def doc_files():
    return [README, *DOCS]


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_point_into_the_repository(md):
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        if target.startswith("#"):
            why = None if target[1:] in anchors(md) else "no such heading"
        else:
            why = broken_target(md.parent, target)
        if why:
            bad.append(f"{target}: {why}")
    assert not bad, f"{md.relative_to(ROOT)}: broken links: {bad}"


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_file_references_exist(md):
    """Paths in backticks that start with a top-level folder of the repository (csrc/...,
    tests/..., docs/...), and any .md path, name files that exist."""
    text = md.read_text(encoding="utf-8")
    bad = []
    for m in re.finditer(r"`([\w.\-]+(?:/[\w.\-*]+)+/?)(?:::\w+)?`", text):
        ref = m.group(1)
        first = ref.split("/")[0]
        if first not in TOP_DIRS and not ref.endswith(".md"):
            continue
        if not (list(ROOT.glob(ref.rstrip("/"))) or list(md.parent.glob(ref.rstrip("/")))):
            bad.append(ref)
    assert not bad, f"{md.relative_to(ROOT)} names files not in the repository: {bad}"


def test_code_comments_link_to_existing_doc_sections():
    """References like docs/ARCHITECTURE.md#one-training-step in the code and tests."""
    bad = []
    sources = [p for d in ("axonn_c", "csrc", "tests", "examples", "benchmarks")
               for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".c", ".h", ".sh")]
    for src in sources:
        for m in re.finditer(r"docs/([\w.\-]+\.md)(?:#([\w\-]+))?", src.read_text(encoding="utf-8")):
            doc = ROOT / "docs" / m.group(1)
            if not doc.exists():
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)} (no such file)")
            elif m.group(2) and m.group(2) not in anchors(doc):
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)} (no such heading)")
    assert not bad, bad


def test_no_reference_to_the_old_design_document():
    hits = [str(p.relative_to(ROOT)) for p in [README, *DOCS, *ROOT.glob("axonn_c/*.py"),
                                                 *ROOT.glob("csrc/**/*.[ch]"),
                                                 *ROOT.glob("examples/*.py")]
            if "DESIGN §" in p.read_text(encoding="utf-8")]
    assert not hits, f"'DESIGN §' (a document not in the repository) in {hits}"


def test_docs_index_lists_every_document():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"
    assert "](docs/README.md)" in README.read_text(encoding="utf-8")


def test_architecture_lists_every_environment_setting():
    used = set()
    for d in ("axonn_c", "csrc", "tests/workers", "benchmarks"):
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".c", ".h", ".sh"):
                used |= set(re.findall(r"AXONN_C_[A-Z_]+[A-Z]", p.read_text(encoding="utf-8")))
    used |= set(re.findall(r"AXONN_C_[A-Z_]+[A-Z]", (ROOT / "setup.py").read_text()))
    table = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, f"docs/ARCHITECTURE.md's settings table lacks {missing}"


def c_settings_table():
    """The rows (name, read by, default, meaning) of csrc/core/env.c's `settings[]`, each cell
    the concatenation of its C string literals."""
    text = (ROOT / "csrc" / "core" / "env.c").read_text(encoding="utf-8")
    start = text.index("settings[] = {")
    block = text[start:text.index("\n};", start)]
    rows = []
    for entry in re.findall(r"\{((?:\s*\"(?:[^\"\\]|\\.)*\"\s*,?)+)\s*\}", block):
        cells, cur = [], ""
        for lit, comma in re.findall(r"\"((?:[^\"\\]|\\.)*)\"(\s*,)?", entry):
            cur += ast.literal_eval(f'"{lit}"')
            if comma:
                cells.append(cur)
                cur = ""
        rows.append(tuple(cells + [cur]))
    return rows


def docs_settings_table():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    lines = text[text.index("| variable | read by | default | effect |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        name, read_by, dflt, meaning = (c.strip() for c in line.strip("|").split(" | "))
        rows.append((name.strip("`"), read_by, dflt, meaning))
    return rows


def test_architecture_settings_table_is_the_c_table():
    c_rows = c_settings_table()
    assert len(c_rows) >= 15 and all(len(r) == 4 for r in c_rows), c_rows
    assert docs_settings_table() == c_rows, (
        "docs/ARCHITECTURE.md's settings table differs from csrc/core/env.c's (keep them equal)")


def test_core_reads_settings_only_through_the_table():
    """No getenv of an AXONN_C_* setting in the core outside env.c, and every setting the core
    reads through axc_env_* is in the table."""
    names = {r[0] for r in c_settings_table()}
    bad, read = [], set()
    for p in (ROOT / "csrc").rglob("*.c"):
        if "tests" in p.parts or p.name == "env.c":
            continue
        text = p.read_text(encoding="utf-8")
        bad += [f"{p.relative_to(ROOT)}: {m}" for m in re.findall(r"getenv\(\"AXONN_C_\w+", text)]
        read |= set(re.findall(r"axc_env_\w+\(\"(AXONN_C_\w+)\"", text))
        read |= set(re.findall(r"\"(AXONN_C_\w+)\", \d+,", text))  # dynlib specs' path settings
    assert not bad, f"getenv of a setting outside csrc/core/env.c: {bad}"
    assert read and read <= names, f"read but not in csrc/core/env.c's table: {read - names}"


def test_torch_requirement_keeps_an_installed_torch():
    """pip installs a requirement only when what is installed does not satisfy it: a lower
    bound that the installed torch meets (whatever its local build label, +cpu or +cu130)
    never pulls a second torch, and the build itself needs none."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert not any(r.split(";")[0].strip().lower().startswith("torch")
                   for r in meta["build-system"]["requires"])
    torch_reqs = [Requirement(r) for r in meta["project"]["dependencies"]
                  if Requirement(r).name == "torch"]
    assert len(torch_reqs) == 1
    spec = torch_reqs[0].specifier
    assert all(s.operator == ">=" for s in spec), f"torch{spec}: a lower bound only"
    installed = Version(torch.__version__)
    assert spec.contains(installed, prereleases=True), f"torch {installed} does not meet {spec}"
    assert spec.contains(Version("2.13.0+cu130")) and spec.contains(Version("2.13.0+cpu"))
