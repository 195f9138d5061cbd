"""python -m compilecast.demo"""

import sys

from compilecast.demo import main

sys.exit(main())
