"""``python -m tutorial_lib.train --help`` (torchrun: ``torchrun ... -m tutorial_lib.train ...``).

The process leaves with ``os._exit`` once :func:`~tutorial_lib.train.cli.main` has returned (the process
group destroyed, the metrics and checkpoints on disk): the interpreter's teardown can otherwise abort
(SIGABRT, "terminate called without an active exception") in gloo's native threads after a run that
finished cleanly, and torchrun would report the whole job as failed -- the launcher's ranks leave the
same way for the same reason. An exception (a failure while training) is printed with its traceback first
and the status is 1."""

import os
import sys
import traceback

from tutorial_lib.train.cli import main

if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors (status 2) and --help (0)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # a failure while training: its traceback, status 1 (the process group is destroyed)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
