"""The front door works as written: the README stays a short front page, its links and the docs'
links resolve, and every ```python block of README.md and docs/*.md runs on CPU.

Fences: ```python blocks are executed; ```python-gpu marks the few blocks that need a CUDA device,
several processes or a model the page does not build (they are parsed as Python here, so they cannot rot into syntax errors, and
each names a test or example that runs the same thing); ```text / ```bash / ```console / plain
fences are not run. A page's ```python blocks run in order in one namespace of their own (later
blocks may use what earlier ones defined), in a working directory of their own, on CPU with CUDA
hidden and Triton's interpreter on; one child interpreter runs all pages (torch is imported once).
New pages under docs/ are picked up without editing this file.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted([README, *(ROOT / "docs").glob("*.md")])
LINKED = sorted({*PAGES, *(ROOT / "bench" / "results").glob("*.md"), *(ROOT / "examples").glob("*.md")})
RUN_TAGS = {"python", "py", "python3"}
#: Python-looking fences that are deliberately not run (any non-Python fence is not run either).
SKIP_TAGS = {"python-gpu"}
README_MAX_LINES = 200

_FENCE = re.compile(r"^(?P<indent> *)```(?P<tag>[^\s`]*)\s*$")


def blocks_from_text(text: str, name: str = "text") -> list[tuple[str, int, str]]:
    """(tag, first line, code) of every fenced block of a markdown text."""
    out, tag, start, buf = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if tag is None and m:
            tag, start, buf = m["tag"], i + 1, []
        elif tag is not None and line.strip() == "```":
            out.append((tag, start, "\n".join(buf) + "\n"))
            tag = None
        elif tag is not None:
            buf.append(line)
    assert tag is None, f"{name}: a ``` fence opened at line {start - 1} is never closed"
    return out


def blocks(path: pathlib.Path) -> list[tuple[str, int, str]]:
    return blocks_from_text(path.read_text(), path.name)


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    text = README.read_text()
    # The Quickstart has exactly the two commands CI and a newcomer run.
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (fence,) = [code for tag, _, code in blocks_from_text(quick)]
    commands = [ln.split("#")[0].strip() for ln in fence.splitlines() if ln.split("#")[0].strip()]
    assert commands == ["make bench", "make test"], commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci, "CI must run the README's test command"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_fences_are_known_and_gpu_blocks_parse(page):
    for tag, line, code in blocks(page):
        assert tag in RUN_TAGS | SKIP_TAGS or not tag.lower().startswith("py"), (
            f"{_rel(page)}:{line}: unknown fence ```{tag}; use ```python (run on CPU by this test), "
            "```python-gpu (needs CUDA or several processes) or ```text"
        )
        if tag in RUN_TAGS | {"python-gpu"}:
            try:
                ast.parse(code)
            except SyntaxError as e:
                pytest.fail(f"{_rel(page)}:{line + (e.lineno or 1) - 1}: not valid Python: {e.msg}")
        if tag in RUN_TAGS:
            assert 'device="cuda"' not in code and ".cuda()" not in code, (
                f"{_rel(page)}:{line}: a ```python block runs on CPU here; pick the device "
                "(`'cuda' if torch.cuda.is_available() else 'cpu'`) or mark it ```python-gpu"
            )


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", LINKED, ids=_rel)
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)   # links inside code are code
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):     # http(s):, mailto: -- not fetched (no network in CI)
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{_rel(page)}: broken links: " + "; ".join(bad)


def _cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


_RUNNABLE = [p for p in PAGES if any(tag in RUN_TAGS for tag, _, _ in blocks(p))]

# One interpreter runs every page (importing torch and tritonmoe once instead of once per page):
# each page gets a fresh namespace and working directory; its blocks run in order and the first
# failure's traceback is recorded for that page's test.
_RUNNER = """
import json, os, sys, traceback
pages = json.loads(sys.argv[1])
out = {}
for name, work, parts in pages:
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    ns = {"__name__": "__main__"}
    try:
        for where, code in parts:
            exec(compile(code, where, "exec"), ns)
        out[name] = None
    except BaseException:
        out[name] = traceback.format_exc()[-4000:]
    sys.stdout.flush()
print("@@RESULTS@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("docs")
    pages = [[_rel(p), str(work / _rel(p).replace("/", "_")),
              [[f"{_rel(p)}:{line}", code] for tag, line, code in blocks(p) if tag in RUN_TAGS]] for p in _RUNNABLE]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(pages)], cwd=work, env=_cpu_env(),
                          capture_output=True, text=True, timeout=900)
    marker = proc.stdout.rfind("@@RESULTS@@")
    assert marker >= 0, f"the docs runner died (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout[marker + len("@@RESULTS@@"):])


@pytest.mark.slow
@pytest.mark.parametrize("page", _RUNNABLE, ids=_rel)
def test_python_blocks_run_on_cpu(page, page_results):
    err = page_results[_rel(page)]
    assert err is None, f"{_rel(page)}: a ```python block failed on CPU:\n{err}"
