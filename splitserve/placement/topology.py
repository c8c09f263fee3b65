"""CPU topology and Packrat's resource allocator (Packrat §3.4).

``read_topology`` lists the CPUs this process may run on with their socket and core, from
sysfs. ``allocate`` gives each model instance its own CPUs: disjoint, never more threads than
CPUs, and socket-local whenever an instance fits in one socket, since an instance spread
over two NUMA domains pays for cross-socket memory traffic on every operator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.errors import InvalidInput

logger = logging.getLogger(__name__)

SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Core:
    """One logical CPU: its id (as ``taskset`` and ``sched_setaffinity`` use it), the
    physical core it belongs to (SMT siblings share it) and its socket (physical package)."""

    cpu: int
    core: int
    socket: int


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_topology(sysfs: Path = SYSFS_CPU, allowed: set[int] | None = None) -> list[Core]:
    """The CPUs in ``allowed`` (default: this process's affinity mask), sorted by CPU id.

    Socket and core come from ``cpuN/topology/physical_package_id`` and ``core_id``. Where
    sysfs lacks them (some containers and VMs hide it) the CPU is put on socket 0 as a core
    of its own, which is the safe reading: nothing is kept apart that could share a socket,
    and SMT siblings are never assumed.
    """
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    cores = []
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        socket = _read_int(topo / "physical_package_id")
        core = _read_int(topo / "core_id")
        # Some kernels report -1 for an unknown package; treat it like a missing file.
        cores.append(
            Core(
                cpu=cpu,
                core=cpu if core is None or core < 0 else core,
                socket=0 if socket is None or socket < 0 else socket,
            )
        )
    return cores


def _by_socket(cores: Sequence[Core]) -> dict[int, list[int]]:
    """CPU ids per socket, each list in (core, cpu) order so SMT siblings sit together."""
    free: dict[int, list[int]] = {}
    for c in sorted(cores, key=lambda c: (c.socket, c.core, c.cpu)):
        free.setdefault(c.socket, []).append(c.cpu)
    return free


def _take(n: int, free: dict[int, list[int]], what: str) -> list[int]:
    """Remove and return ``n`` CPUs of ``free`` (which must hold at least ``n``): from the
    lowest-numbered socket with ``n`` free, else spread over the sockets with the most free."""
    socket = next((s for s in sorted(free) if len(free[s]) >= n), None)
    if socket is not None:
        taken = free[socket][:n]
        del free[socket][:n]
        return sorted(taken)
    logger.warning("%s (%d CPUs) does not fit in the free CPUs of any one socket; spreading it across sockets",
                   what, n)
    taken = []
    for s in sorted(free, key=lambda s: (-len(free[s]), s)):
        grab = min(n - len(taken), len(free[s]))
        taken += free[s][:grab]
        del free[s][:grab]
        if len(taken) == n:
            break
    return sorted(taken)


def take_cpus(n: int, cores: Sequence[Core], what: str = "a partition") -> list[int]:
    """``n`` CPU ids out of ``cores``, ascending, on one socket whenever one socket has ``n``
    (neighbouring cores, SMT siblings together), else spread over the fullest sockets (logged
    as a warning naming ``what``). The resource manager carves partitions with it.

    Raises InvalidInput when ``n`` is below 1 or ``cores`` has fewer than ``n`` CPUs.
    """
    if n < 1:
        raise InvalidInput(f"{what} asks for {n} CPUs; it needs >= 1")
    if n > len(cores):
        raise InvalidInput(f"{what} needs {n} CPUs but only {len(cores)} are given ({sorted(c.cpu for c in cores)})")
    return _take(n, _by_socket(cores), what)


def allocate(thread_counts: Sequence[int], cores: Sequence[Core]) -> list[list[int]]:
    """CPU ids for each instance: ``result[i]`` has ``thread_counts[i]`` CPUs, ascending.

    Instances are placed first-fit decreasing over sockets: the instance with the most
    threads (the earlier one on ties) goes to the lowest-numbered socket with enough free
    CPUs. Within a socket CPUs are taken in (core, cpu) order, so an instance's threads land
    on neighbouring cores and SMT siblings stay in the same instance rather than two instances
    sharing a physical core. When every instance fits a socket but the free CPUs left are
    fragmented across sockets, the instance is spread over the sockets with the most free
    CPUs (logged as a warning: slower, but better than refusing to serve).

    ``cores`` is what the caller may use: for Packrat, the budget partition the resource
    manager granted the model, never more.

    Raises InvalidInput when a thread count is below 1, when the total demand exceeds the
    CPUs available, or when one instance needs more CPUs than any socket has.
    """
    for i, n in enumerate(thread_counts):
        if n < 1:
            raise InvalidInput(f"instance {i} asks for {n} threads; every instance needs >= 1")
    demand = sum(thread_counts)
    if demand > len(cores):
        raise InvalidInput(
            f"the plan needs {demand} CPUs in all but only {len(cores)} are available "
            f"({sorted(c.cpu for c in cores)}); plan for T <= {len(cores)}"
        )
    free = _by_socket(cores)
    largest = max((len(v) for v in free.values()), default=0)
    result: list[list[int]] = [[] for _ in thread_counts]
    order = sorted(range(len(thread_counts)), key=lambda i: (-thread_counts[i], i))
    for i in order:
        n = thread_counts[i]
        if n > largest:
            raise InvalidInput(
                f"instance {i} needs {n} threads but the largest socket has {largest} CPUs; "
                "Packrat keeps each instance on one socket, so use instances of at most "
                f"{largest} threads"
            )
        result[i] = _take(n, free, f"instance {i}")
    return result
