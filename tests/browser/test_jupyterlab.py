"""A reader's JupyterLab session, for real: open a lesson, Run All, read what the page shows.

For lesson 00 and one distributed lesson (05: 2 gloo ranks on CPU, spawned from the kernel), each
with the parameters cell's defaults (``device="auto"``, ``world_size=2``, ``quick=True``):

    the file      nbformat is current (4.5: cell ids), every cell has an id, the kernelspec is the one
                  the set-up installs (ipykernel's "python3" in the project's environment)
    open          the kernel starts without a kernel-picker dialog, from the project's Python; opening
                  changes no cell and not the format (saved right away and compared). JupyterLab does
                  record the running kernel's ``kernelspec``/``language_info`` in the notebook's metadata
                  and marks the tab modified when they differ from the stored ones; ``language_info``
                  holds the Python version, so no committed notebook matches every reader's kernel. The
                  test allows exactly those two keys to change, and checks the modified mark agrees.
    Run All       through the menu; every code cell gets an execution count, no output is an error,
                  every self-check cell prints its pass line, >= 1 matplotlib figure is decoded as an
                  image in the page, and the kernel is idle afterwards

Screenshots: ``output/browser/<lesson>-opened.png`` and ``<lesson>-ran.png`` (the first figure in view).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from tutorial_lib.harness.checks import PASS_MARK
from tutorial_lib.harness.notebooks import KERNEL_NAME, SELF_CHECK_TAG, verify_executed

LESSONS = ["00_start_here.ipynb", "05_dtensor.ipynb"]
RUN_TIMEOUT = 420  # seconds for Run All; papermill needs 10-20 s per lesson on a 2-core CPU
KERNEL_METADATA = {"kernelspec", "language_info"}  # what JupyterLab records from the running kernel

CURRENT_TAB = ".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current"
INDICATOR = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator"


def _kernel_status(page) -> str | None:
    return page.get_attribute(INDICATOR, "data-status")


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(".jp-Notebook .jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.textContent.trim())")


def _dirty(page) -> bool:
    return "jp-mod-dirty" in (page.get_attribute(CURRENT_TAB, "class") or "")


def _dialogs(page) -> list[str]:
    return page.eval_on_selector_all(".jp-Dialog", "els => els.map(e => e.innerText)")


def _save(page, path: Path, timeout: float = 30) -> nbformat.NotebookNode:
    """Ctrl+S in the notebook, wait until the tab is clean and the file changed; return the saved notebook."""
    before = path.stat().st_mtime_ns
    page.focus(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")  # command mode: Ctrl+S saves
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + timeout
    while True:
        if not _dirty(page) and path.stat().st_mtime_ns != before:
            try:  # the server writes the file in place: a read can catch it half-written
                return nbformat.read(path, as_version=4)
            except (ValueError, nbformat.reader.NotJSONError):
                pass
        assert time.monotonic() < deadline, f"saving {path.name} from JupyterLab did not finish in {timeout} s"
        time.sleep(0.2)


def _wait_for_kernel(page, server, name: str, timeout: float = 180) -> dict:
    """Wait until the server has a kernel session for ``name`` whose kernel is idle, as the page shows too;
    return the session's kernel (id, name, execution_state)."""
    deadline = time.monotonic() + timeout
    while True:
        dialogs = _dialogs(page)
        assert not dialogs, f"a dialog opened instead of the kernel starting: {dialogs}"
        sessions = [s for s in server.api("GET", "/api/sessions") if s["path"].endswith(name)]
        assert len(sessions) <= 1, f"more than one kernel session for {name}: {sessions}"
        if sessions and sessions[0]["kernel"]["execution_state"] == "idle" and _kernel_status(page) == "idle":
            return sessions[0]["kernel"]
        assert time.monotonic() < deadline, (
            f"no idle kernel for {name} after {timeout} s: sessions {sessions}, page shows {_kernel_status(page)!r}")
        time.sleep(0.3)


def _run_all(page, timeout: float) -> float:
    """Run > Run All Cells; wait until no cell is queued or running and the kernel is idle; return seconds."""
    start = time.monotonic()
    page.click('.lm-MenuBar-itemLabel:text-is("Run")')
    page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
    settled = 0
    while settled < 3:  # idle with nothing queued on three polls in a row (cells are queued one by one)
        assert time.monotonic() - start < timeout, (
            f"Run All did not finish in {timeout} s; prompts {_prompts(page)}, kernel {_kernel_status(page)!r}")
        time.sleep(0.5)
        busy = _kernel_status(page) != "idle" or "[*]:" in _prompts(page)
        settled = 0 if busy else settled + 1
    return time.monotonic() - start


def _error_text(nb) -> str:
    errors = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    ansi = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
    return "\n".join(f"cell {i}: {o.get('ename')}: {o.get('evalue')}\n"
                     + ansi.sub("", "\n".join(o.get("traceback", []))) for i, o in errors)


def _kernel_executable(server, kernel_id: str) -> str:
    """The interpreter of the kernel process the server started for ``kernel_id`` (its connection file names it)."""
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        cmd = proc.cmdline()
        if "ipykernel_launcher" in cmd and any(kernel_id in part for part in cmd):
            return cmd[0]
    raise AssertionError(f"no ipykernel process for kernel {kernel_id} under the server")


@pytest.mark.browser
@pytest.mark.parametrize("name", LESSONS, ids=[n.removesuffix(".ipynb") for n in LESSONS])
def test_lesson_runs_in_jupyterlab(name, page, lab_server, screenshots):
    path = lab_server.root / name
    stem = path.stem

    # the file as committed
    committed = nbformat.read(path, as_version=4)
    assert (committed.nbformat, committed.nbformat_minor) == (nbformat.current_nbformat,
                                                              nbformat.current_nbformat_minor), (
        f"{name} is nbformat {committed.nbformat}.{committed.nbformat_minor}: JupyterLab would upgrade it on open")
    assert all(c.get("id") for c in committed.cells), f"{name} has cells without an id: JupyterLab would add them"
    assert committed.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME
    assert KERNEL_NAME in lab_server.api("GET", "/api/kernelspecs")["kernelspecs"], (
        f"the server knows no kernel {KERNEL_NAME!r}: the set-up installs ipykernel into the environment")

    # open it as a reader does: the kernel starts, no kernel-picker dialog
    page.goto(lab_server.lab_url(name))
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", timeout=120_000)
    kernel = _wait_for_kernel(page, lab_server, name)
    assert kernel["name"] == KERNEL_NAME
    exe = _kernel_executable(lab_server, kernel["id"])
    assert Path(exe).resolve() == Path(sys.executable).resolve(), (
        f"the kernel runs {exe}, not the project's environment's Python {sys.executable}")
    page.screenshot(path=str(screenshots / f"{stem}-opened.png"))

    # opening changed nothing of the lesson: save at once and compare with the committed file
    marked_modified = _dirty(page)
    opened = _save(page, path)
    assert (opened.nbformat, opened.nbformat_minor) == (committed.nbformat, committed.nbformat_minor)
    assert opened.cells == committed.cells, f"opening {name} in JupyterLab changed its cells"
    changed = {k for k in set(opened.metadata) | set(committed.metadata)
               if opened.metadata.get(k) != committed.metadata.get(k)}
    assert changed <= KERNEL_METADATA, f"opening {name} changed notebook metadata {sorted(changed)}"
    assert marked_modified == bool(changed), (
        f"the tab was {'' if marked_modified else 'not '}marked modified, but opening changed {sorted(changed)}")
    print(f"{name}: opened; JupyterLab recorded the kernel's metadata {sorted(changed) or 'nothing'}")

    # Run All through the menu, then what the page shows, saved and read back
    seconds = _run_all(page, RUN_TIMEOUT)
    assert not _dialogs(page), f"a dialog is open after Run All: {_dialogs(page)}"
    state = lab_server.api("GET", f"/api/kernels/{kernel['id']}")["execution_state"]
    assert state == "idle" and _kernel_status(page) == "idle", f"the kernel is {state!r} after Run All, not idle"
    ran = _save(page, path)
    errors = _error_text(ran)
    assert not errors, f"{name} raised in JupyterLab:\n{errors}"
    prompts = _prompts(page)
    assert prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), f"not every code cell ran: prompts {prompts}"
    cells, passed = verify_executed(ran)  # every code cell ran, every self-check cell printed its pass line
    self_checks = [c for c in ran.cells if SELF_CHECK_TAG in c.get("metadata", {}).get("tags", [])]
    shown = page.locator(f".jp-OutputArea-output:has-text('{PASS_MARK}')").count()
    assert shown >= len(self_checks), f"{shown} outputs show {PASS_MARK!r} in the page, {len(self_checks)} self-checks"
    images = page.eval_on_selector_all(".jp-OutputArea-output img",
                                       "els => els.map(e => [e.naturalWidth, e.naturalHeight])")
    assert any(w > 0 and h > 0 for w, h in images), f"no figure was rendered as an image in the page: {images}"
    assert any("image/png" in o.get("data", {}) for c in ran.cells if c.cell_type == "code" for o in c.outputs)
    page.locator(".jp-OutputArea-output img").first.scroll_into_view_if_needed()
    page.screenshot(path=str(screenshots / f"{stem}-ran.png"))
    print(f"{name}: Run All took {seconds:.1f} s; {cells} code cells, {passed} checks passed, {len(images)} images")
