"""`python -m tfdist.emulated`: the emulated cluster's command (implemented in
`tfdist.tools.emulated`)."""

import sys

from tfdist.tools.emulated import main

if __name__ == "__main__":
    sys.exit(main())
