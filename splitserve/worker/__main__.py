import sys

from splitserve.worker.process import main

sys.exit(main())
