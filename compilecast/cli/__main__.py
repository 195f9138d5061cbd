"""python -m compilecast.cli"""

import sys

from compilecast.cli import main

sys.exit(main())
