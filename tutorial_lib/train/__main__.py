"""``python -m tutorial_lib.train --help`` (torchrun: ``torchrun ... -m tutorial_lib.train``)."""

import sys

from tutorial_lib.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
