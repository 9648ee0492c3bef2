"""A real JupyterLab server and a headless Chromium for the browser tests.

The server runs from the interpreter running the tests (the project's environment), on a free
loopback port with a random token, over a temporary copy of ``notebooks/`` (nothing in the
repository is written), with its own config, runtime, settings and workspace folders. Chromium is
Debian's ``chromium`` package (or ``$CHROMIUM``), driven by Playwright; Playwright's own browser
downloads are never used.

Where Chromium or Playwright is missing the tests skip with the reason -- except under ``CI=true``,
where that is a failure (``.ci/run`` installs Chromium). Screenshots go to ``output/browser/``
(git-ignored), one more named ``*-FAILED.png`` when a test fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tutorial_lib.harness.notebooks import NOTEBOOK_DIR, REPO_ROOT

SCREENSHOTS = REPO_ROOT / "output" / "browser"
CHROMIUM_FLAGS = [  # headless as root in a sandboxed CI, and no calls to the outside network
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-quic",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# JupyterLab settings a fresh reader would not notice, set so that nothing pops up over the notebook
# (the news toast) and every cell stays in the page (no virtual scrolling), so the test sees them all.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives JupyterLab in a headless Chromium")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def unavailable(reason: str):
    """Skip with ``reason`` on a developer's machine; fail under ``CI=true``: CI must run the browser tests."""
    if in_ci():
        pytest.fail(f"{reason} -- CI=true, so this is a failure, not a skip (.ci/run installs Chromium)",
                    pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@dataclass
class LabServer:
    """A running JupyterLab: its base URL, token, notebook folder, process and log file."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen
    log: Path

    def api(self, method: str, path: str, body: dict | None = None):
        """Call the server's REST API (``/api/...``) with the token; return the decoded JSON (or None)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def lab_url(self, notebook: str) -> str:
        # ?reset: start from an empty workspace, so tabs of earlier tests are not restored
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def shutdown_kernels(self) -> None:
        for session in self.api("GET", "/api/sessions") or []:
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels") or []:
            self.api("DELETE", f"/api/kernels/{kernel['id']}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server then shuts its kernels down), SIGKILL to the server's process group after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session=True: the group is this server's alone
            proc.wait(10)


@pytest.fixture(scope="module")  # torn down when the browser tests end: no stray processes for later tests
def lab_server(tmp_path_factory):
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        unavailable("JupyterLab is not installed: pip install -e '.[dev]'")
    base = tmp_path_factory.mktemp("jupyterlab")
    root = base / "notebooks"
    shutil.copytree(NOTEBOOK_DIR, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for rel, values in LAB_SETTINGS.items():
        path = base / "settings" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "MPLBACKEND") and not k.startswith("JPY_")}  # as a reader's shell
    env.update(JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_RUNTIME_DIR=str(base / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(base / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"))
    port, token = _free_port(), secrets.token_hex(16)
    log = base / "server.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.allow_root=True"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = LabServer(f"http://127.0.0.1:{port}", token, root, proc, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode} before it was ready:\n{server.log_tail()}")
            try:
                server.api("GET", "/api/status")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 120 s:\n{server.log_tail()}")
                time.sleep(0.5)
        yield server
    finally:
        try:
            if proc.poll() is None:
                server.shutdown_kernels()
        except (urllib.error.URLError, OSError):
            pass  # stopping the server below shuts down what is left
        _stop(proc)


@pytest.fixture(scope="module")  # torn down when the browser tests end: no stray processes for later tests
def chromium_path() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        unavailable("no Chromium: install Debian's `chromium` package (apt-get install chromium) or set $CHROMIUM")
    return path


@pytest.fixture(scope="module")  # torn down when the browser tests end: no stray processes for later tests
def browser(chromium_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("Playwright is not installed: pip install -e '.[dev]'")
    pw = sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        pw.stop()


@pytest.fixture
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture
def page(browser, request):
    """A fresh browser page; a screenshot ``output/browser/<test>-FAILED.png`` if the test failed."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    try:
        yield pg
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            name = request.node.name.replace("[", "-").replace("]", "").replace("/", "_")
            try:
                pg.screenshot(path=str(SCREENSHOTS / f"{name}-FAILED.png"))
            except Exception as exc:  # a crashed page: the test's own error matters more
                print(f"no failure screenshot: {exc}")
        context.close()
