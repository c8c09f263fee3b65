import signal

# A terminal's Ctrl-C is the server's to handle: it drains this worker rather than have
# every batch fail at once. Ignored before anything else runs (torch's import is slow).
signal.signal(signal.SIGINT, signal.SIG_IGN)

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from splitserve.worker.process import main  # noqa: E402

code = main()
# Everything the worker owns is released by the kernel (mappings, sockets, the preemption page);
# an interpreter teardown with torch loaded costs ~1 s of CPU at every stop, unload and recycle.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
