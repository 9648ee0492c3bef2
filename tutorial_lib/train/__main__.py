"""``python -m tutorial_lib.train --help`` (torchrun: ``torchrun ... -m tutorial_lib.train ...``).

The process leaves with ``os._exit`` once :func:`~tutorial_lib.train.cli.main` has returned (the process
group destroyed, the metrics and checkpoints on disk): the interpreter's teardown can otherwise abort
(SIGABRT, "terminate called without an active exception") in gloo's native threads after a run that
finished cleanly, and torchrun would report the whole job as failed -- the launcher's ranks leave the
same way for the same reason."""

import os
import sys

from tutorial_lib.train.cli import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
