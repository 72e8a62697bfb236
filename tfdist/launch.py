"""`python -m tfdist.launch`: the worker launcher's command (implemented in `tfdist.tools.launch`)."""

import sys

from tfdist.tools.launch import main

if __name__ == "__main__":
    sys.exit(main())
