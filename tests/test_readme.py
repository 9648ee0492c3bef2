"""Every command the README shows is run here (or by CI), so the README cannot rot.

``make test`` is CI's own command (.ci/run). The rest run below, on small inputs; GPU-only forms
are run on a GPU node and, on a CPU machine, must fail with a clear message instead of running on
the wrong hardware.
"""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent
GPU = torch.cuda.is_available()


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    cmds = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip() if not line.strip().startswith("#") else ""
            if line:
                cmds.append(line)
    return cmds


# command -> the test below that exercises it ("ci" = .ci/run runs it)
EXERCISED = {
    "make lessons": "test_make_lessons",
    "make test": "ci",
    "make lab": "test_make_lab",
    ".venv/bin/python -m tutorial_lib.harness.notebooks run notebooks/00_start_here.ipynb --device cpu "
    "--world-size 2 --quick -p rank_device=cpu":
        "test_run_one_lesson_cli",
    "TRITON_INTERPRET=1 .venv/bin/python -m papermill notebooks/00_start_here.ipynb output/00.ipynb -k python3 "
    "-p device cpu "
    "-p world_size 2 "
    "-p quick True": "test_papermill_command",
    'make test ARGS="--nb-device cuda"': "test_gpu_commands",
    'make test ARGS="--nb-device cuda -n 8"': "test_gpu_test_arguments_are_accepted",
    ".venv/bin/python -m tutorial_lib.harness.notebooks run --device cuda --world-size 2 --full": "test_gpu_commands",
}


def _run(cmd: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def _venv(cmd: str) -> str:
    """README commands name .venv/bin/...; run them with the interpreter running the tests."""
    return re.sub(r"(^|\s)\.venv/bin/python(?=\s)", lambda m: m.group(1) + sys.executable,
                  re.sub(r"(^|\s)\.venv/bin/(?!python\s)", lambda m: f"{m.group(1)}{VENV_BIN}/", cmd))


def test_every_readme_command_is_exercised():
    missing = [c for c in readme_commands() if c not in EXERCISED]
    assert not missing, f"README commands with no test: {missing}"
    stale = [c for c in EXERCISED if c not in readme_commands()]
    assert not stale, f"tests exercise commands the README no longer shows: {stale}"


@pytest.mark.notebook
def test_make_lessons(tmp_path):
    """The main job, limited to lesson 00, with its output moved to a temporary folder."""
    venv = Path(sys.prefix)
    r = _run(f"make lessons VENV={venv} LESSONS=notebooks/00_start_here.ipynb ARGS='--out {tmp_path}'")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"executed notebooks: {tmp_path / 'executed'}" in r.stdout
    index = tmp_path / "html" / "index.html"
    assert f"HTML rendering:     {index}" in r.stdout
    assert "00_start_here.html" in index.read_text()
    assert "CHECK PASSED" in (tmp_path / "html" / "00_start_here.html").read_text()
    assert "1 passed, 0 failed" in r.stdout


def test_make_lab():
    """``make lab`` sets up JupyterLab and starts it on notebooks/ (here with --version, which exits)."""
    venv = Path(sys.prefix)
    r = _run(f"make lab VENV={venv} ARGS=--version")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{venv}/bin/python -m jupyterlab notebooks/ --version" in r.stdout, r.stdout
    assert re.search(r"^\d+\.\d+\.\d+\s*$", r.stdout, flags=re.M), r.stdout  # the version line (make may add
    # "Entering directory" lines when it runs inside another make, as under `make test`)
    r = _run(f"{VENV_BIN}/jupyter kernelspec list --json")
    assert r.returncode == 0 and '"python3"' in r.stdout, r.stdout + r.stderr


@pytest.mark.notebook
def test_run_one_lesson_cli():
    cmd = next(c for c in EXERCISED if "notebooks run notebooks/00" in c)
    r = _run(_venv(cmd))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   00_start_here.ipynb" in r.stdout and "1 passed, 0 failed" in r.stdout
    assert "'rank_device': 'cpu'" in r.stdout, "the -p parameter reached the lesson"


@pytest.mark.notebook
def test_papermill_command(tmp_path):
    cmd = next(c for c in EXERCISED if "papermill" in c).replace("output/00.ipynb", str(tmp_path / "00.ipynb"))
    r = _run(_venv(cmd))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHECK PASSED" in (tmp_path / "00.ipynb").read_text()


def test_gpu_commands(tmp_path):
    run_cmd = next(c for c in EXERCISED if "--device cuda --world-size 2 --full" in c)
    if GPU:  # with one GPU the lessons' ranks run on CPU (rank_placement): the command works there too
        r = _run(_venv(run_cmd) + f" --out {tmp_path}", timeout=3600)
        assert r.returncode == 0, r.stdout + r.stderr
        return
    # On a CPU machine both forms must refuse clearly rather than run on the wrong hardware.
    r = _run(_venv(run_cmd) + f" --out {tmp_path} notebooks/00_start_here.ipynb")
    assert r.returncode != 0
    assert "device='cuda' was requested but torch sees no CUDA device" in r.stdout + r.stderr

def test_gpu_test_arguments_are_accepted():
    """``make test ARGS=...`` passes its ARGS to pytest; the GPU node runs the whole suite with them
    (that run is recorded in the README); here we check pytest accepts them and collects the lessons."""
    pytest_cmds = [c for c in EXERCISED if "--nb-device cuda" in c]
    assert len(pytest_cmds) == 2, pytest_cmds   # serial, and in pytest-xdist workers
    for pytest_cmd in pytest_cmds:
        args = re.search(r'ARGS="([^"]+)"', pytest_cmd).group(1)
        r = _run(f"{sys.executable} -m pytest {args} --collect-only -q tests/harness/test_notebooks.py")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "test_lesson_runs[00_start_here]" in r.stdout, r.stdout


def test_benchmark_table_matches_recorded_results():
    from tutorial_lib.harness.bench_report import README_END, README_START, results_markdown

    block = README.split(README_START, 1)[1].split(README_END, 1)[0].strip()
    assert block == results_markdown(ROOT / "benchmarks" / "results").strip(), (
        "README's benchmark table is stale: run `python -m tutorial_lib.harness.bench_report`"
    )


def _experiment_block() -> str:
    section = README.split("## Using tutorial_lib in your own experiments", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section shows one runnable example"
    return blocks[0]


@pytest.mark.distributed
def test_own_experiment_example_runs(tmp_path):
    """The README's "Using tutorial_lib in your own experiments" block, saved as a script and run as shown."""
    script = tmp_path / "my_experiment.py"
    script.write_text(_experiment_block())
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "losses:" in r.stdout and "MXFP8Tensor" in r.stdout, r.stdout


def test_own_experiment_example_uses_only_the_public_api():
    names = set(re.findall(r"\btl\.(\w+)", _experiment_block()))
    import tutorial_lib

    missing = sorted(names - set(tutorial_lib.__all__))
    assert not missing, f"not exported by tutorial_lib: {missing}"


def _tutorial_lib_object(dotted: str):
    """``a.b.c`` looked up from ``tutorial_lib``'s top level, importing submodules on the way."""
    import tutorial_lib

    obj = tutorial_lib
    for part in dotted.split("."):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            importlib.import_module(f"{obj.__name__}.{part}")
        obj = getattr(obj, part)
    return obj


def test_production_switches_table_names_resolve():
    """Every name of the "our API" column of "From these lessons to production switches" exists in
    tutorial_lib and accepts the arguments the table shows (a format string must be a registry name),
    so the table cannot drift from the library."""
    import tutorial_lib

    title = "## From these lessons to production switches"
    assert title in README, f"README has no section {title!r}"
    section = README.split(title, 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    header = rows[0]
    assert header[:3] == ["concept", "lessons", "our API (`tutorial_lib`)"] and header[-1] == "what it costs", header
    spans = []
    for row in rows[2:]:
        assert len(row) == len(header), f"a row with {len(row)} cells, not {len(header)}: {row[0]}"
        spans += re.findall(r"`([^`]+)`", row[2])
    assert len(rows) - 2 >= 16 and len(spans) >= 30, (len(rows), spans)
    for span in spans:
        expr = ast.parse(span, mode="eval").body
        call = expr if isinstance(expr, ast.Call) else None
        obj = _tutorial_lib_object(ast.unparse(call.func if call else expr))
        if call is None:
            continue
        inspect.signature(obj).bind_partial(*call.args, **{k.arg: None for k in call.keywords})  # TypeError if not
        if obj in (tutorial_lib.recipe, tutorial_lib.make_quantizer):
            assert ast.literal_eval(call.args[0]) in tutorial_lib.FORMAT_NAMES, span


@pytest.mark.parametrize("doc", ["README.md", "SECURITY.md", "docs/verified_runs.md"])
def test_relative_links_resolve(doc):
    """Every relative link of the repository's markdown files names a file or folder that exists (a moved
    section or a renamed lesson leaves no dead link); a ``#fragment`` must be one of the target's headings."""
    source = ROOT / doc
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", source.read_text(), flags=re.S))  # code is not links
    links = re.findall(r"(?<!\\)\]\(([^)\s]+)\)", prose)   # an escaped \] is literal text
    relative = [u for u in links if not re.match(r"[a-z][a-z0-9+.-]*:", u)]
    if doc == "README.md":
        assert len(relative) > 12, "README.md: the lesson table's links were not found -- the pattern is wrong"
    for url in relative:
        path, _, fragment = url.partition("#")
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{doc}: link ({url}) names {target.relative_to(ROOT)}, which does not exist"
        if fragment and target.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.*)$", target.read_text(), flags=re.M)}
            assert fragment in slugs, f"{doc}: link ({url}): no heading of {path or doc} has the anchor #{fragment}"
