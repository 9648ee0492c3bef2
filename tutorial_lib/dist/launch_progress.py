"""What the caller of a launch sees while its ranks run: their output, and a bar of ranks finished.

The launcher (:func:`tutorial_lib.dist.launcher.launch`) polls both every 0.2 s while it waits for
its ranks:

* :class:`LogTail` re-prints each rank's new output lines, prefixed ``[rank r]`` (in Jupyter a
  child's stdout is not the cell, so the caller prints for it), and keeps each rank's last lines for
  the error message of a rank that dies without a traceback.
* :class:`RanksFinished` is a progress bar (:func:`tutorial_lib.harness.progress.progress`) with
  ``total = world_size``, advanced when a rank's result file appears -- a rank writes it as its last
  act, by an atomic rename -- so it reaches ``world_size`` exactly when every rank has a result.
  Its kind follows the helper's rules: a widget in JupyterLab, a text bar in a terminal, and in an
  executed notebook (papermill) or a pipe nothing for launches shorter than 30 s, then at most one
  line per 30 s; ``TUTORIAL_PROGRESS=off`` silences it. The rank lines are printed through
  :func:`tutorial_lib.harness.progress.note`, so they never tear a text bar on screen.

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

import os
from collections.abc import Callable

from tutorial_lib.harness.progress import note, progress

# ranks finish together, not at a rate: the bar shows the count and the elapsed time, no rate or ETA
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]"


def _print_line(line: str) -> None:
    print(line, flush=True)


class LogTail:
    """Re-print what the ranks write to ``<tmp>/rank<r>.log``, line by line, prefixed with their rank.

    ``write`` prints one line (default: ``print``); ``last_lines[r]`` holds rank r's last 20 lines
    (kept with ``echo=False`` too: the launcher quotes them when a rank dies without a traceback).
    """

    def __init__(self, tmp: str, world_size: int, echo: bool, write: Callable[[str], None] = _print_line):
        self.paths = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        self.offsets = [0] * world_size
        self.partial = [""] * world_size
        self.last_lines: list[list[str]] = [[] for _ in range(world_size)]
        self.echo = echo
        self.write = write

    def pump(self, final: bool = False) -> None:
        """Read what each rank wrote since the last call; ``final``: also its unterminated last line."""
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[rank])
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            self.offsets[rank] += len(chunk)
            text = self.partial[rank] + chunk.decode("utf-8", errors="replace")
            lines = text.split("\n")
            self.partial[rank] = "" if final else lines.pop()
            for line in lines:
                if final and not line:
                    continue
                self.last_lines[rank] = (self.last_lines[rank] + [line])[-20:]
                if self.echo:
                    self.write(f"[rank {rank}] {line}")


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
