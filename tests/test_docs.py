"""Every code block of README.md and docs/*.md runs as printed (issue 26), in the order a reader
meets them: README first, then the pages, all in one scratch directory that holds what a clone
holds (``examples/``), with the commands of this environment on PATH.

A block that cannot run here says so on the line above it, with its reason, and is checked
another way:

    <!-- doc-test: skip: REASON -->   bash: every ``mergekit-darts`` line is parsed by the real command
                                      line (options and arguments exist); python: it compiles
    <!-- doc-test: fragment -->       yaml: a part of a config; its ``surgery:`` keys must exist

Every other ``yaml`` block is a whole config: its ``surgery:`` block is validated by the schema and
its merge part by mergekit's. Fences without a language are output, not run.
"""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(skip|fragment)\s*(?::\s*(.*?))?\s*-->\s*$")
# the README's test command (between these markers; .ci/run extracts it) is the suite itself
TEST_COMMAND = "<!-- test-command -->"
RUN_LANGS = {"bash", "python", "yaml"}


def blocks(path: Path):
    """(page, line number, language, code, marker, reason) of each fenced block."""
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        start, lang = index, match.group(1)
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        above = lines[start - 1] if start else ""
        marker = MARKER.match(above)
        kind, reason = (marker.group(1), marker.group(2) or "") if marker else (None, "")
        if above.strip() == TEST_COMMAND:
            kind, reason = "skip", "the test command: CI (.ci/run) runs it; the suite cannot run itself"
        found.append((path.relative_to(REPO).as_posix(), start + 1, lang, "\n".join(lines[start + 1:end]),
                      kind, reason))
        index = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def _id(block):
    return f"{block[0]}:{block[1]}"


def test_every_runnable_block_has_a_language_and_every_marker_a_reason():
    for page, line, lang, code, marker, reason in ALL:
        if marker == "skip":
            assert len(reason) > 10, f"{page}:{line}: say why the block cannot run here"
        if lang == "" and marker:
            raise AssertionError(f"{page}:{line}: a marker above an output block")
        if lang and lang not in RUN_LANGS | {"text", "console", "jinja"}:
            raise AssertionError(f"{page}:{line}: unknown language {lang!r}")


# --- yaml: validated, never run ------------------------------------------------------------------

@pytest.mark.parametrize("block", [b for b in ALL if b[2] == "yaml"], ids=_id)
def test_yaml_blocks_are_valid_configs(block):
    from mergekit_darts.config import SurgeryConfig, parse_surgery_block

    page, line, _, code, marker, _ = block
    data = yaml.safe_load(code)
    assert isinstance(data, dict), f"{page}:{line}: not a mapping"
    if marker == "fragment":
        unknown = set(data.get("surgery") or {}) - set(SurgeryConfig.model_fields)
        assert not unknown, f"{page}:{line}: unknown surgery keys {unknown}"
        return
    if "surgery" in data:
        parse_surgery_block(data["surgery"])
    merge = {k: v for k, v in data.items() if k not in ("surgery", "sweep")}
    if merge:
        from mergekit.config import MergeConfiguration

        MergeConfiguration.model_validate(merge)


# --- skipped blocks: checked without running -----------------------------------------------------

def _command_lines(code: str):
    for raw in code.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;", raw.split("  #")[0]):
            words = shlex.split(part, comments=True)
            if words:
                yield words


@pytest.mark.parametrize("block", [b for b in ALL if b[4] == "skip"], ids=_id)
def test_skipped_blocks_still_parse(block):
    import click

    from mergekit_darts.cli import main

    page, line, lang, code, _, _ = block
    if lang == "python":
        compile(code, f"{page}:{line}", "exec")
        return
    for words in _command_lines(code):
        if words[0] != "mergekit-darts":
            continue
        args = [w for w in words[1:] if not re.fullmatch(r"\[.*\]", w)]  # "[--private]": optional, as usage shows
        command = main.get_command(None, args[0])
        assert command is not None, f"{page}:{line}: no command {args[0]!r}"
        try:
            with click.Context(main, info_name="mergekit-darts") as parent:
                command.make_context(args[0], args[1:], parent=parent)
        except click.exceptions.Exit:
            pass
        except click.UsageError as error:
            raise AssertionError(f"{page}:{line}: {' '.join(words)}: {error}") from None


# --- everything else runs, in reading order, in one scratch directory ----------------------------

def _scratch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reader")
    os.symlink(REPO / "examples", root / "examples")
    return root


def _env(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HOME=str(root / "home"),
               MPLCONFIGDIR=str(root / "home" / "mpl"))
    return env


# One interpreter runs every python block in turn (imports are paid once), each with fresh globals:
# a block that uses a name it does not import or define itself fails, as it would for a reader.
PYTHON_WORKER = r"""
import json, sys, traceback
replies, sys.stdout = sys.stdout, sys.stderr  # what a block prints must not mix with the replies
for request in sys.stdin:
    name, code = json.loads(request)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc()[-3000:]
    replies.write(json.dumps(error) + "\n")
    replies.flush()
"""


def test_blocks_run_as_printed(tmp_path_factory):
    """README's blocks, then each page's, in reading order, as a reader runs them."""
    import json

    root = _scratch(tmp_path_factory)
    env = _env(root)
    worker = subprocess.Popen([sys.executable, "-c", PYTHON_WORKER], cwd=root, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    failures, timings = [], []
    try:
        for page in PAGES:
            rel = page.relative_to(REPO).as_posix()
            for _, line, lang, code, marker, _ in blocks(page):
                if marker or lang not in ("bash", "python"):
                    continue
                began = time.perf_counter()
                if lang == "python":
                    worker.stdin.write(json.dumps([f"{rel}:{line}", code]) + "\n")
                    worker.stdin.flush()
                    error = json.loads(worker.stdout.readline())
                    if error:
                        failures.append(f"{rel}:{line}:\n{error}")
                else:
                    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=root, env=env,
                                            capture_output=True, text=True, timeout=900)
                    if result.returncode != 0:
                        failures.append(f"{rel}:{line}: exit {result.returncode}\n{code}\n{result.stderr[-3000:]}")
                timings.append(f"{rel}:{line} {lang} {time.perf_counter() - began:.1f} s")
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    print("\n".join(timings))
    assert not failures, "\n\n".join(failures)
    # what the documented commands wrote is git-ignored in a clone
    written = [p.name + ("/" if p.is_dir() else "") for p in root.iterdir() if p.name not in ("examples", "home")]
    left = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], cwd=REPO, text=True,
                          input="\n".join(written), capture_output=True).stdout
    unignored = [line.split("\t")[-1] for line in left.splitlines() if line.startswith("::")]
    assert not unignored, f"documented commands write files a clone does not ignore: {unignored}"


# --- the surgery: key table (docs/options.md) is the schema's ------------------------------------

def _literals(annotation):
    """The values a Literal (inside Optional / Union / Annotated) allows."""
    from typing import Literal, get_args, get_origin

    if get_origin(annotation) is Literal:
        return set(get_args(annotation))
    found = set()
    for arg in get_args(annotation):
        found |= _literals(arg)
    return found


def _schema_fields():
    from mergekit_darts.config import CalibrationConfig, DomainConfig, SurgeryConfig

    fields = dict(SurgeryConfig.model_fields)
    fields.update({f"domains.<name>.{k}": v for k, v in DomainConfig.model_fields.items()})
    fields.update({f"domains.<name>.calibration.{k}": v for k, v in CalibrationConfig.model_fields.items()})
    return fields


def _documented_keys():
    rows = {}
    for line in (REPO / "docs" / "options.md").read_text().splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*?) \| (.*?) \| (.*) \|$", line)
        if match:
            key, values, default, meaning = match.groups()
            assert key not in rows, f"{key} documented twice"
            rows[key] = (values, default, meaning)
    return rows


def _literal_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def test_the_options_table_is_the_schema():
    rows, fields = _documented_keys(), _schema_fields()
    assert set(rows) == set(fields), (f"undocumented: {sorted(set(fields) - set(rows))}; "
                                      f"not in the schema: {sorted(set(rows) - set(fields))}")
    for key, info in fields.items():
        values, default, meaning = rows[key]
        assert meaning.strip(), key
        if info.is_required():
            assert "required" in default, f"{key}: required in the schema"
        elif info.default is not None:
            assert default == f"`{_literal_text(info.default)}`", f"{key}: the schema's default is {info.default!r}"
        allowed = _literals(info.annotation)
        if info.annotation is bool or allowed == {True, False}:
            allowed = {True, False}
        listed = set(re.findall(r"`([^`]+)`", values))
        if allowed:
            expected = {_literal_text(v) for v in allowed}
            union = "map" in values  # a Literal or a map (device_map)
            assert (expected <= listed) if union else (listed == expected), f"{key}: accepts {sorted(expected)}"


# --- links between the pages resolve -------------------------------------------------------------

def _anchors(path: Path) -> set:
    """GitHub's heading anchors of a page."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_relative_links_resolve_to_files_and_headings():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_named_benchmark_scripts_exist():
    """Every ``benchmarks/<folder>/<script>.py`` that a page, a benchmark's README or docstring, a test or the
    package names is there (the scripts live in one folder per question: benchmarks/README.md)."""
    sources = [*PAGES, *(REPO / "benchmarks").rglob("*.md"), *(REPO / "benchmarks").glob("*/*.py"),
               *(REPO / "tests").glob("*.py"), *(REPO / "mergekit_darts").rglob("*.py")]
    missing = sorted({f"{path.relative_to(REPO)}: {name}" for path in sources
                      for name in re.findall(r"benchmarks/[\w/]+\.py", path.read_text())
                      if not (REPO / name).is_file()})
    assert not missing, missing


def test_the_front_page_is_short():
    assert len((REPO / "README.md").read_bytes()) <= 10_000
