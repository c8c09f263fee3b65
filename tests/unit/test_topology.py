"""CPU topology from a fake sysfs tree, and the socket-aware allocator."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from splitserve.errors import InvalidInput
from splitserve.placement.topology import Core, allocate, read_topology


def fake_sysfs(root: Path, layout: dict[int, tuple[int, int]]) -> Path:
    """Write cpuN/topology/{physical_package_id,core_id} for {cpu: (socket, core)}."""
    for cpu, (socket, core) in layout.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{socket}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def two_sockets(tmp_path: Path) -> list[Core]:
    """2 sockets x 8 cores, no SMT: CPUs 0-7 on socket 0, 8-15 on socket 1."""
    root = fake_sysfs(tmp_path, {cpu: (cpu // 8, cpu % 8) for cpu in range(16)})
    return read_topology(root, allowed=set(range(16)))


def socket_of(cores: list[Core]) -> dict[int, int]:
    return {c.cpu: c.socket for c in cores}


def check_disjoint_and_sized(result: list[list[int]], counts: list[int]) -> None:
    assert [len(cpus) for cpus in result] == counts
    flat = [cpu for cpus in result for cpu in cpus]
    assert len(flat) == len(set(flat))
    assert all(cpus == sorted(cpus) for cpus in result)


def test_parses_two_sockets_of_eight_cores(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    assert len(cores) == 16
    assert [c.cpu for c in cores] == list(range(16))
    assert cores[3] == Core(cpu=3, core=3, socket=0)
    assert cores[12] == Core(cpu=12, core=4, socket=1)


def test_allowed_set_restricts_the_cpus(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {cpu: (cpu // 8, cpu % 8) for cpu in range(16)})
    cores = read_topology(root, allowed={1, 9, 10})
    assert [(c.cpu, c.socket) for c in cores] == [(1, 0), (9, 1), (10, 1)]


def test_missing_topology_files_fall_back_to_one_socket(tmp_path: Path) -> None:
    (tmp_path / "cpu0").mkdir()  # a container that hides topology/
    cores = read_topology(tmp_path, allowed={0, 1, 2})
    assert cores == [Core(0, 0, 0), Core(1, 1, 0), Core(2, 2, 0)]


def test_real_machine_parses() -> None:
    cores = read_topology()
    assert len(cores) >= 1
    assert {c.cpu for c in cores} <= os.sched_getaffinity(0)
    result = allocate([1] * len(cores), cores)
    check_disjoint_and_sized(result, [1] * len(cores))


def test_allocation_is_disjoint_and_socket_local(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    sockets = socket_of(cores)
    for counts in ([4, 4, 4, 4], [8, 8], [8, 4, 4], [2, 2, 2, 2, 2, 2, 2, 2], [1, 7, 3, 5], [6]):
        result = allocate(counts, cores)
        check_disjoint_and_sized(result, counts)
        for cpus in result:
            assert len({sockets[cpu] for cpu in cpus}) == 1, (counts, result)


def test_first_fit_decreasing_places_big_instances_first(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    # In input order, 4 + 4 would fill socket 0 halfway and leave no socket for the 8.
    result = allocate([4, 8, 4], cores)
    assert result == [[8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6, 7], [12, 13, 14, 15]]


def test_allocation_is_deterministic(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    assert allocate([3, 3, 2], cores) == allocate([3, 3, 2], list(reversed(cores)))


def test_refuses_oversubscription_with_demand_and_supply(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    with pytest.raises(InvalidInput, match=r"needs 17 CPUs.*only 16"):
        allocate([8, 8, 1], cores)


def test_refuses_an_instance_larger_than_any_socket(tmp_path: Path) -> None:
    cores = two_sockets(tmp_path)
    with pytest.raises(InvalidInput, match=r"9 threads.*largest socket has 8"):
        allocate([9], cores)


def test_refuses_empty_instances(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        allocate([2, 0], two_sockets(tmp_path))


def test_fragmented_sockets_spread_an_instance_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cores = two_sockets(tmp_path)
    with caplog.at_level(logging.WARNING, logger="splitserve.placement.topology"):
        result = allocate([5, 5, 5], cores)  # 5 + 5 leave 3 free CPUs on each socket
    check_disjoint_and_sized(result, [5, 5, 5])
    sockets = socket_of(cores)
    assert [len({sockets[c] for c in cpus}) for cpus in result] == [1, 1, 2]
    assert "spreading it across sockets" in caplog.text


def test_smt_siblings_stay_in_one_instance(tmp_path: Path) -> None:
    # 2 sockets x 4 cores x 2 threads, Linux numbering: CPU n and n + 8 are siblings.
    layout = {cpu: ((cpu % 8) // 4, cpu % 4) for cpu in range(16)}
    cores = read_topology(fake_sysfs(tmp_path, layout), allowed=set(range(16)))
    core_of = {c.cpu: (c.socket, c.core) for c in cores}
    result = allocate([2, 2, 2, 2], cores)
    assert result == [[0, 8], [1, 9], [2, 10], [3, 11]]
    for cpus in result:
        assert len({core_of[c] for c in cpus}) == 1


def test_two_core_machine(tmp_path: Path) -> None:
    cores = read_topology(fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1)}), allowed={0, 1})
    assert allocate([2], cores) == [[0, 1]]
    assert allocate([1, 1], cores) == [[0], [1]]
    assert allocate([], cores) == []
    with pytest.raises(InvalidInput):
        allocate([2, 1], cores)
