"""Progress bars for long work: a widget in JupyterLab, text in a terminal, quiet in executed notebooks.

One call, :func:`progress`, returns a ``tqdm`` bar whose kind depends on where the code runs
(:func:`progress_mode`)::

    where                                                  mode      what it shows
    a kernel started by a Jupyter server (JupyterLab),     widget    tqdm's ipywidgets bar, after 0.5 s
      ipywidgets installed
    the same without ipywidgets                            text      tqdm's text bar on stderr, after 0.5 s
    a terminal (stderr is a TTY, no kernel)                text      tqdm's text bar on stderr, after 0.5 s
    any other kernel (papermill, nbclient) or a pipe       quiet     a text bar only once the work has taken
      (CI logs, pytest)                                              ``quiet_after`` s, refreshed at most every
                                                                     ``quiet_after`` s: short loops print nothing

An executed notebook keeps every stream message as an output of its own, so a bar refreshed ten
times a second would leave hundreds of outputs in a papermill run; a widget would leave its state in
the notebook's metadata. Quiet mode leaves at most one line per ``quiet_after`` seconds of work, and
writes each as a complete line (:class:`LineWriter`): there is no screen to redraw in place there, so
a carriage return or a clear would only leave a blank output or a run-on line in a log.
``TUTORIAL_PROGRESS=widget|text|quiet|off`` overrides the choice.

Example::

    from tutorial_lib.harness.progress import progress

    for size in progress([1 << 10, 1 << 20, 1 << 24], desc="sizes", unit="size"):
        ...                                           # one sweep point per iteration
    with progress(total=4, desc="ranks finished", unit="rank") as bar:
        bar.update(1)                                 # manual updates, e.g. while waiting for ranks
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import std

MODES = ("widget", "text", "quiet", "off")
ENV_VAR = "TUTORIAL_PROGRESS"
SHOW_AFTER = 0.5  # seconds before an interactive bar appears: instant loops show nothing


def _kernel_shell() -> bool:
    """True inside an IPython kernel (not a terminal IPython): its output goes to a notebook."""
    ipython = sys.modules.get("IPython")
    if ipython is None or "ipykernel" not in sys.modules:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def progress_mode() -> str:
    """Which bar :func:`progress` makes here: "widget", "text", "quiet" or "off" (see the module docstring).

    A Jupyter server sets ``JPY_SESSION_NAME`` in the environment of every kernel it starts for a
    notebook; papermill and nbclient start kernels without it.
    """
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"{ENV_VAR} must be one of {MODES}, got {forced!r}")
        return forced
    if _kernel_shell():
        if not os.environ.get("JPY_SESSION_NAME"):
            return "quiet"
        return "widget" if _has_widgets() else "text"
    stream = sys.stderr
    return "text" if stream is not None and hasattr(stream, "isatty") and stream.isatty() else "quiet"


class LineWriter:
    """A file for quiet bars: each redraw of the bar becomes one line; clears and blank lines are dropped.

    ``tqdm`` redraws a bar in place (``"\\r" + text``), clears it with spaces before a :func:`note`, and
    ends it with a newline. Written as they are into a notebook output or a log, the redraws run on as
    one line and the clears become blank outputs; through this writer only the non-blank texts arrive,
    each ended by a newline.
    """

    def __init__(self, file):
        self.file = file

    def write(self, text: str) -> int:
        for part in text.replace("\n", "\r").split("\r"):
            if part.strip():
                self.file.write(part.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        getattr(self.file, "flush", lambda: None)()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str | None = None,
             unit: str = "it", quiet_after: float = 30.0, enabled: bool = True, **kwargs) -> std.tqdm:
    """A ``tqdm`` bar over ``iterable`` (or a manual one with ``total``), of the kind :func:`progress_mode` picks.

    Args:
        iterable: what to iterate over; ``None`` for a bar advanced with ``bar.update(n)``.
        total: number of steps when ``iterable`` has no ``len()`` or is ``None``.
        desc: the label in front of the bar.
        unit: what one step is called ("size", "rank", "lesson").
        quiet_after: in quiet mode, seconds of work before the first line and between two lines.
        enabled: ``False`` makes a disabled bar whatever the mode (e.g. on every rank but one).
        kwargs: passed on to ``tqdm`` (they override the mode's settings).

    Returns:
        the bar; iterate over it, or use it as a context manager and call ``update``. In mode "off"
        (or with ``enabled=False``) it is a disabled bar that prints nothing.
    """
    if quiet_after <= 0:
        raise ValueError(f"quiet_after must be > 0 seconds, got {quiet_after}")
    mode = progress_mode() if enabled else "off"
    options = dict(total=total, desc=desc, unit=unit)
    if mode == "widget":
        from tqdm.notebook import tqdm as widget_tqdm

        return widget_tqdm(iterable, **{**options, "delay": SHOW_AFTER, **kwargs})
    if mode == "text":
        return std.tqdm(iterable, **{**options, "delay": SHOW_AFTER, "file": sys.stderr, **kwargs})
    if mode == "quiet":
        quiet = {"delay": quiet_after, "mininterval": quiet_after, "maxinterval": max(quiet_after, 10.0),
                 "ncols": 100, "file": sys.stderr}
        merged = {**options, **quiet, **kwargs}
        return std.tqdm(iterable, **{**merged, "file": LineWriter(merged["file"])})
    return std.tqdm(iterable, **{**options, "disable": True, **kwargs})


def note(bar: std.tqdm, message: str, file=None) -> None:
    """Print ``message`` as a line of its own next to ``bar`` (from :func:`progress`) without tearing it.

    A text bar on screen is cleared and redrawn below the line (``tqdm.write``); a quiet bar not yet
    shown, a disabled bar and a widget are left alone (``print``), so the line does not make them appear.
    """
    start = getattr(bar, "start_t", None)
    on_screen = (start is not None and not bar.disable and type(bar).__module__ == std.__name__
                 and bar.last_print_t >= start + bar.delay)
    if on_screen:
        bar.write(message, file=file)
    else:
        print(message, file=file, flush=True)
