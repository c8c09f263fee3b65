import signal

# A terminal's Ctrl-C is the server's to handle: it drains this worker rather than have
# every batch fail at once. Ignored before anything else runs (torch's import is slow).
signal.signal(signal.SIGINT, signal.SIG_IGN)

import sys  # noqa: E402

from splitserve.worker.process import exit_after  # noqa: E402

exit_after(sys.argv[1:])
