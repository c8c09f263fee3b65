"""The one GPU partition a worker process may see (``CUDA_VISIBLE_DEVICES``).

A worker is started before anyone knows which model it will serve (a spare), so its GPU
comes with the LOAD (``BindSpec.visible_devices``), not with the process. CUDA reads
``CUDA_VISIBLE_DEVICES`` once, when the process first initialises it; setting it at the
LOAD is therefore exact for a process that has not touched CUDA yet, and a process that
has (it served a GPU model before) can only serve the same partition again: a LOAD naming
another is refused, and the node starts a fresh process for it. This holds only while nothing
in a worker touches CUDA before its first LOAD, ``torch.cuda.is_available()`` included: it
starts the driver, which reads the variable then.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping

from splitserve.errors import InvalidInput

VAR = "CUDA_VISIBLE_DEVICES"


def claim_visible(visible: str | None, cuda_initialized: Callable[[], bool],
                  environ: MutableMapping[str, str] = os.environ) -> None:
    """Make ``visible`` (a GPU-… or MIG-… UUID) the only GPU this process sees, before CUDA
    starts (None: a CPU model, nothing to do). InvalidInput when CUDA already started here
    on another set of devices."""
    if visible is None:
        return
    if not cuda_initialized():
        environ[VAR] = visible
        return
    if environ.get(VAR) != visible:
        raise InvalidInput(f"worker {os.getpid()} already runs CUDA on {environ.get(VAR) or 'every GPU'}; "
                           f"it cannot switch to {visible} (a fresh worker process can)")
