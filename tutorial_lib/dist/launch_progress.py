"""What the caller of a launch sees while its ranks run -- their output, a bar of ranks finished -- and when one fails.

The launcher (:func:`tutorial_lib.dist.launcher.launch`) polls both every 0.2 s while it waits for
its ranks:

* :class:`LogTail` re-prints each rank's new output lines, prefixed ``[rank r]`` (in Jupyter a
  child's stdout is not the cell, so the caller prints for it), and keeps each rank's last lines for
  the error message of a rank that dies without a traceback of its own. A rank's log holds its whole
  output, from its first instruction: the launcher starts it under :func:`rank_output_to`, so even
  a failure while it starts up (running the caller's main script, importing the launcher) is there.
* :class:`RanksFinished` is a progress bar (:func:`tutorial_lib.harness.progress.progress`) with
  ``total = world_size``, advanced when a rank's result file appears -- a rank writes it as its last
  act, by an atomic rename -- so it reaches ``world_size`` exactly when every rank has a result.
  Its kind follows the helper's rules: a widget in JupyterLab, a text bar in a terminal, and in an
  executed notebook (papermill) or a pipe nothing for launches shorter than 30 s, then at most one
  line per 30 s; ``TUTORIAL_PROGRESS=off`` silences it. The rank lines are printed through
  :func:`tutorial_lib.harness.progress.note`, so they never tear a text bar on screen.

When a rank fails, :func:`failure_report` writes the message of the launch's ``RankFailed``: the end
of the traceback of the rank that failed first or, for a rank that died without one, of its output.

Example::

    import tempfile
    from tutorial_lib.dist.launch_progress import LogTail, RanksFinished

    with tempfile.TemporaryDirectory() as tmp:          # the launcher's folder of rank logs and results
        for r in range(2):                              # here two ranks already ran: one line each, then a result
            with open(f"{tmp}/rank{r}.log", "w") as log, open(f"{tmp}/rank{r}.result", "w"):
                print(f"hello from rank {r}", file=log)
        finished = RanksFinished([f"{tmp}/rank{r}.result" for r in range(2)], desc="allreduce_demo")
        tail = LogTail(tmp, world_size=2, echo=True, write=finished.note)
        done = False
        while not done:          # the launcher's wait loop
            tail.pump()          # new "[rank r] ..." lines: "[rank 0] hello from rank 0", ...
            done = finished.poll() == 2   # the bar follows the result files; the elapsed time keeps ticking
        finished.close()         # on success at world_size/world_size; on failure where it stopped
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

try:
    import fcntl
except ImportError:  # Windows: os.dup's copy is numbered above the open fds and not inherited anyway
    fcntl = None

from tutorial_lib.harness.progress import note, progress

# ranks finish together, not at a rate: the bar shows the count and the elapsed time, no rate or ETA
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]"

KEPT_LINES = 60
"""How many of each rank's last output lines :class:`LogTail` keeps."""
ECHOED_LINES = 5_000
"""How many lines of each rank :class:`LogTail` re-prints per launch; then one line says the rest is cut."""
LINE_CHARS = 4_000
"""The longest line :class:`LogTail` keeps or re-prints; a longer one is cut there (the rest of it dropped)."""
_READ_BYTES = 1 << 20  # read at most this much of a rank's log per pump (and per step of a final pump)


_REDIRECT_LOCK = threading.Lock()  # fds 1 and 2 belong to the whole process: one redirection at a time


@contextlib.contextmanager
def rank_output_to(path: str):
    """Point this process's fds 1 and 2 at ``path`` (appending, created 0600) for the duration.

    A process started inside inherits them as its stdout and stderr from its first instruction; a
    spawned rank's start-up runs the caller's main script and imports before any launcher code, and
    its traceback from there would otherwise go to the caller's stderr -- in a notebook, not part of
    the error the cell shows. Hold it only around starting a process (milliseconds): the caller's own
    writes to fds 1 and 2 meanwhile land in ``path`` too, and are echoed with that rank's output.
    Where the caller's fd 1 or 2 is closed, it is closed again afterwards.

    A Ctrl-C (SIGINT) meanwhile is held back and handled after both fds are restored: one between the two
    restores would leave fd 2 on the rank's log, and one while a process is being started would lose it
    before the caller could stop it. (A process started inside gets the default SIGINT handling: an exec
    resets caught signals.)
    """
    with _REDIRECT_LOCK, _sigint_held():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # None, or closed: nothing buffered to keep apart
                stream.flush()
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log = _copy_above_stdio(opened)  # never the number of a closed fd 0, 1 or 2
        os.close(opened)
        saved: dict[int, int | None] = {}
        try:
            for fd in (1, 2):
                try:
                    saved[fd] = _copy_above_stdio(fd)
                except OSError:  # closed in this process
                    saved[fd] = None
                os.dup2(log, fd)
            yield
        finally:
            for fd, copy in saved.items():
                if copy is None:
                    os.close(fd)
                else:
                    os.dup2(copy, fd)
                    os.close(copy)
            os.close(log)


@contextlib.contextmanager
def _sigint_held():
    """Hold a Ctrl-C back inside: SIGINT's Python handler is swapped for one that notes it, and on the way out
    the original handler runs for it (the default one raises KeyboardInterrupt there).

    Not a signal mask: a mask is per thread, and a process-directed SIGINT goes to any thread not blocking it
    (a TCPStore's, a library's), whose wake-up then makes the main thread raise at its next bytecode anyway.
    Python runs signal handlers in the main thread only, so elsewhere there is nothing to hold back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    original = signal.getsignal(signal.SIGINT)
    if original is None:  # installed outside Python: cannot be put back, so left alone
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, original)
        if caught and callable(original):
            original(signal.SIGINT, caught[-1])
        elif caught and original == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)  # what the default disposition does with it: end the process


def _copy_above_stdio(fd: int) -> int:
    """A close-on-exec copy of ``fd`` numbered 3 or above (``os.dup`` would refill a closed fd 1 or 2)."""
    return os.dup(fd) if fcntl is None else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


def _print_line(line: str) -> None:
    print(line, flush=True)


class LogTail:
    """Re-print what the ranks write to ``<tmp>/rank<r>.log``, line by line, prefixed with their rank.

    ``write`` prints one line (default: ``print``); ``last_lines[r]`` holds rank r's last 60 lines
    (kept with ``echo=False`` too: the launcher quotes them when a rank dies without a traceback). Bounded, so a
    rank that floods its output cannot flood the cell or the caller's memory: at most :data:`ECHOED_LINES`
    lines per rank are re-printed, each cut at :data:`LINE_CHARS` characters, and the log is read 1 MB at a time.
    """

    def __init__(self, tmp: str, world_size: int, echo: bool, write: Callable[[str], None] = _print_line):
        self.paths = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        self.offsets = [0] * world_size
        self.partial = [""] * world_size
        self.cutting = [False] * world_size  # inside a line already cut at LINE_CHARS: drop until its newline
        self.echoed = [0] * world_size
        self.last_lines: list[list[str]] = [[] for _ in range(world_size)]
        self.echo = echo
        self.write = write

    def pump(self, final: bool = False) -> None:
        """Read what each rank wrote since the last call; ``final``: all of it, and its unterminated last line."""
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[rank])
                    while True:
                        chunk = fh.read(_READ_BYTES)
                        self.offsets[rank] += len(chunk)
                        self._take(rank, chunk.decode("utf-8", errors="replace"))
                        if not final or len(chunk) < _READ_BYTES:
                            break
            except FileNotFoundError:
                continue
            if final and self.partial[rank]:
                self._line(rank, self.partial[rank])
                self.partial[rank] = ""

    def _take(self, rank: int, text: str) -> None:
        lines = (self.partial[rank] + text).split("\n")
        self.partial[rank] = lines.pop()
        for line in lines:
            if self.cutting[rank]:  # the rest of a cut line ends here
                self.cutting[rank] = False
                continue
            self._line(rank, line)
        if len(self.partial[rank]) > LINE_CHARS and not self.cutting[rank]:
            self._line(rank, self.partial[rank])  # cut now: a line without a newline must not grow without bound
            self.partial[rank], self.cutting[rank] = "", True
        elif self.cutting[rank]:
            self.partial[rank] = ""

    def _line(self, rank: int, line: str) -> None:
        if len(line) > LINE_CHARS:
            line = line[:LINE_CHARS] + " [... line cut]"
        self.last_lines[rank] = (self.last_lines[rank] + [line])[-KEPT_LINES:]
        if self.echo and self.echoed[rank] <= ECHOED_LINES:
            self.echoed[rank] += 1
            self.write(f"[rank {rank}] {line}" if self.echoed[rank] <= ECHOED_LINES else
                       f"[rank {rank}] ... more output not shown (at most {ECHOED_LINES} lines per rank); the last "
                       f"{KEPT_LINES} lines go into the error if the rank fails")


class RanksFinished:
    """A progress bar over the ranks that have finished: rank r counts once ``result_paths[r]`` exists.

    ``desc`` labels the bar (the launcher passes the rank function's name). The bar is made by
    :func:`tutorial_lib.harness.progress.progress` (its mode, delay and rate rules apply) with
    ``miniters=0``, so that :meth:`poll` also refreshes the elapsed time while no rank has finished
    yet -- at most at the mode's rate (every 30 s in an executed notebook).
    """

    def __init__(self, result_paths: list[str], desc: str):
        if not result_paths:
            raise ValueError("RanksFinished needs one result path per rank, got none")
        self.paths = list(result_paths)
        self.done = 0  # ranks with a result at the last poll (a disabled bar counts nothing itself)
        self.bar = progress(total=len(self.paths), desc=f"{desc}: ranks finished", unit="rank", miniters=0,
                            bar_format=_BAR_FORMAT)

    def poll(self) -> int:
        """Advance the bar to the number of ranks whose result exists; return that number."""
        done = sum(os.path.exists(p) for p in self.paths)
        self.bar.update(done - self.done)  # 0: only the clock moves
        self.done = done
        return done

    def note(self, line: str) -> None:
        """Print ``line`` beside the bar without tearing it (:func:`tutorial_lib.harness.progress.note`)."""
        note(self.bar, line)

    def close(self) -> None:
        """Close the bar where it stands: ``world_size`` after a success, fewer after a failure."""
        self.bar.close()


def failure_report(
    tmp: str, world_size: int, exitcodes: list[int | None], last_lines: list[list[str]], first: int | None = None
) -> tuple[str, int, str]:
    """Message, rank and last line for the rank of a launch that failed first.

    ``first`` is the rank torch's join saw exit first; ``exitcodes`` the ranks' exit codes (None: still
    running); ``last_lines`` the ranks' last output lines (:attr:`LogTail.last_lines`). A rank that raised
    wrote its traceback to ``tmp/rank{r}.error`` (its time: when it raised); one that died without
    one -- killed, or failed while starting up, before the launcher's code in it ran -- is described by
    its exit and its last output, where a start-up traceback is. Either is quoted by its last
    ``KEPT_LINES`` lines and ``TAIL_CHARS`` characters; ranks that failed afterwards are named too.
    """
    errors, raised_at = {}, {}
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.error")
        if os.path.exists(path):
            with open(path) as fh:
                errors[r] = fh.read()
            raised_at[r] = os.stat(path).st_mtime_ns  # set by the rank: when it caught the exception
    died = {r: code for r, code in enumerate(exitcodes) if code not in (0, None) and r not in errors}
    # status 0 without a result: the rank's own code left (os._exit, sys.exit) -- the likely cause of the rest
    quit = [r for r, code in enumerate(exitcodes) if code == 0 and r not in errors
            and not os.path.exists(os.path.join(tmp, f"rank{r}.result"))]
    died.update({r: 0 for r in quit})
    if quit:
        first = quit[0]
    elif first is None or (first not in errors and first not in died):
        candidates = sorted(died) or sorted(errors)
        first = candidates[0] if candidates else -1
    if first in errors:  # a caller that polled late sees the ranks that failed because of it exit too: the
        first = min(errors, key=lambda r: (raised_at[r], r))  # first exception is the cause
    text = ""
    if first in errors:
        text = last_part(errors[first])
        msg = f"rank {first} of {world_size} raised:\n{text}"
    elif first in died:
        code = died[first]
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        text = last_part("\n".join(last_lines[first]))
        what = ("exited with status 0 before returning a result (an os._exit or sys.exit in the code it ran?)"
                if code == 0 else f"died with {how} without reaching the launcher's error report")
        msg = f"rank {first} of {world_size} {what}; its last output (stdout and stderr since it started):\n" \
              f"{text or '(none)'}"
    else:
        msg = f"the launch on {world_size} ranks ended without a result from every rank"
    others = sorted((set(errors) | set(died)) - {first})
    if others:
        msg += f"\n(ranks {others} failed afterwards, most likely waiting on rank {first})"
    return msg, first, next((line for line in reversed(text.splitlines()) if line.strip()), "")


TAIL_CHARS = 4000
"""How many characters of a failed rank's traceback or output :func:`failure_report` quotes (and at most
``KEPT_LINES`` lines)."""


def last_part(text: str) -> str:
    """The end of a rank's traceback or output: at most ``KEPT_LINES`` lines and ``TAIL_CHARS`` characters."""
    text = text.rstrip("\n")
    kept = "\n".join(text.split("\n")[-KEPT_LINES:])[-TAIL_CHARS:]
    if len(kept) == len(text):
        return text
    return f"[... {len(text) - len(kept)} earlier characters left out]\n{kept}"
