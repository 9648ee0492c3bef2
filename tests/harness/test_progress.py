"""Progress bars: the right kind in each place, and nothing printed where it would spam an executed notebook."""

import io
import os
import sys
import time

import nbformat
import pytest

from tutorial_lib.harness import progress as pg


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(pg.ENV_VAR, raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)


@pytest.fixture
def fake_kernel(monkeypatch):
    """Make ``progress_mode`` see an IPython kernel's shell (as in a notebook), without starting one."""
    ipython = pytest.importorskip("IPython")
    pytest.importorskip("ipywidgets")
    shell_cls = type("ZMQInteractiveShell", (), {})
    monkeypatch.setattr(ipython, "get_ipython", lambda: shell_cls())
    pytest.importorskip("ipykernel")  # in sys.modules, as in a kernel (no kernel runs: widgets get a dummy comm)


def test_override_and_bad_override(monkeypatch):
    for mode in pg.MODES:
        monkeypatch.setenv(pg.ENV_VAR, mode.upper())
        assert pg.progress_mode() == mode
    monkeypatch.setenv(pg.ENV_VAR, "fancy")
    with pytest.raises(ValueError, match="TUTORIAL_PROGRESS must be one of"):
        pg.progress_mode()


def test_terminal_gets_text_and_a_pipe_gets_quiet(monkeypatch, no_override):
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert pg.progress_mode() == "text"
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert pg.progress_mode() == "quiet"


def test_kernels_started_by_jupyterlab_get_a_widget_others_stay_quiet(monkeypatch, no_override, fake_kernel):
    assert pg.progress_mode() == "quiet"  # papermill / nbclient: no JPY_SESSION_NAME
    monkeypatch.setenv("JPY_SESSION_NAME", "/lessons/00_start_here.ipynb")  # what a Jupyter server sets
    assert pg.progress_mode() == "widget"
    bar = pg.progress(range(3), desc="sizes")
    assert type(bar).__module__ == "tqdm.notebook" and bar.delay == pg.SHOW_AFTER
    assert list(bar) == [0, 1, 2]


def test_quiet_mode_prints_nothing_for_short_work(monkeypatch):
    monkeypatch.setenv(pg.ENV_VAR, "quiet")
    out = io.StringIO()
    assert sum(pg.progress(range(10_000), desc="fast", file=out)) == sum(range(10_000))
    assert out.getvalue() == ""


def test_quiet_mode_prints_at_most_one_line_per_interval(monkeypatch):
    monkeypatch.setenv(pg.ENV_VAR, "quiet")
    out, interval = io.StringIO(), 0.1
    start = time.monotonic()
    for _ in pg.progress(range(12), desc="slow", quiet_after=interval, file=out):
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n"), "each line complete: nothing to redraw in a log or a notebook"
    lines = text.splitlines()
    assert lines and all(line.strip() for line in lines) and "12/12" in lines[-1], text
    assert len(lines) <= elapsed / interval + 2, (len(lines), elapsed)


def test_a_note_beside_a_shown_quiet_bar_leaves_no_blank_output(monkeypatch, capsys):
    """A text bar is cleared before a line is printed beside it; a quiet one has no screen to clear."""
    monkeypatch.setenv(pg.ENV_VAR, "quiet")
    err = io.StringIO()
    bar = pg.progress(total=3, desc="ranks", quiet_after=0.01, file=err, miniters=0)
    time.sleep(0.05)
    bar.update(1)  # shown: past quiet_after
    pg.note(bar, "[rank 0] hello")
    bar.update(2)
    bar.close()
    assert capsys.readouterr().out == "[rank 0] hello\n"
    lines = err.getvalue().split("\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1]), err.getvalue()
    assert "1/3" in lines[0] and "3/3" in lines[-2], err.getvalue()


def test_line_writer_drops_clears_and_ends_each_redraw():
    out = io.StringIO()
    writer = pg.LineWriter(out)
    for text in ("\rstep 1/3", "\r" + " " * 40 + "\r", "", "\rstep 3/3   ", "\n"):
        assert writer.write(text) == len(text)
    assert out.getvalue() == "step 1/3\nstep 3/3\n"


def test_off_disabled_and_bad_interval(monkeypatch):
    monkeypatch.setenv(pg.ENV_VAR, "off")
    out = io.StringIO()
    with pg.progress(total=5, file=out) as bar:
        bar.update(5)
    assert bar.disable and out.getvalue() == ""
    monkeypatch.setenv(pg.ENV_VAR, "text")
    with pg.progress(total=5, file=out, enabled=False) as bar:
        bar.update(5)
    assert bar.disable and out.getvalue() == "", "enabled=False wins over the mode"
    with pytest.raises(ValueError, match="quiet_after"):
        pg.progress(range(3), quiet_after=0)


def test_note_leaves_a_hidden_bar_hidden(monkeypatch, capsys):
    monkeypatch.setenv(pg.ENV_VAR, "quiet")
    err = io.StringIO()
    bar = pg.progress(range(3), file=err)
    pg.note(bar, "ok   00_start_here")
    bar.close()
    assert capsys.readouterr().out == "ok   00_start_here\n" and err.getvalue() == ""


def test_a_papermill_kernel_is_quiet(tmp_path, monkeypatch):
    """A real kernel started the way papermill starts one (nbclient): quiet, so executed notebooks stay clean."""
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv(pg.ENV_VAR, raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from tutorial_lib.harness.progress import progress_mode\n"
                                          "print(progress_mode())")]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": os.getcwd()}},
                            ).execute()
    assert nb.cells[0].outputs[0]["text"].strip() == "quiet"
