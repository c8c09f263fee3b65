"""A GPU node's partitions as values, and the pure planner of MIG geometry changes.

On a GPU node a partition is a whole GPU or an existing MIG slice (a GPU instance with its
compute instance). ``placement.gpus`` reads them through NVML into the values here
(``Gpu``, ``MigSlice``, ``MigProfile``, ``GpuListing``); ``plan_geometry`` turns a GPU's
current layout and a target geometry (``"4g,3g"``, ``"4g.20gb,3g.20gb"``) into the ordered
``nvidia-smi`` commands that would realise it, after checking the geometry against the GPU's
profiles: each profile's count, the GPU's compute slices, and a placement of every instance on
the GPU's memory slices (the check that refuses (3g,3g,1g), which the counts alone allow).

Pure: nothing here reads a GPU or runs a command. ``placement.gpus.MigDriver`` runs a plan,
and only when an administrator started splitserve with ``--gpu-admin``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.errors import InvalidInput
from splitserve.protean.geometry import COMPUTE_UNITS, MIG_A100_MEM_UNITS, MIG_MAX_COUNT

A100_MEM_SLICE_GB = 5  # Table 2: an A100 40GB has 8 memory slices of 5 GB


@dataclass(frozen=True)
class MigProfile:
    """A GPU instance profile as NVML describes it (``nvidia-smi mig -lgip``): ``slices``
    compute slices ("g"), ``mem_mb`` of memory, at most ``max_count`` on one GPU, and the
    ``placements`` (start, size) on the GPU's memory slices where one may sit (empty when
    the driver did not say: the count and compute checks still apply)."""

    name: str  # what nvidia-smi prints and -cgi takes: "3g.20gb"
    id: int  # nvidia-smi's profile id (-lgip's ID column)
    slices: int
    mem_mb: int
    max_count: int
    placements: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {"name": self.name, "id": self.id, "slices": self.slices, "mem_mb": self.mem_mb,
                "max_count": self.max_count, "placements": [list(p) for p in self.placements]}


# The A100 40GB's GPU instance profiles: Table 2's counts and memory (protean.geometry holds
# them for Algorithm 2), with the profile ids and memory-slice placements NVIDIA's MIG user
# guide gives. Used when NVML cannot list an A100's profiles (MIG still off); every other GPU's
# profiles come from NVML and are never assumed.
_A100_IDS = {1: 19, 2: 14, 3: 9, 4: 5, 7: 0}
_A100_STARTS = {1: range(7), 2: range(0, 6, 2), 3: (0, 4), 4: (0,), 7: (0,)}
A100_40GB_PROFILES: tuple[MigProfile, ...] = tuple(
    MigProfile(name=f"{g}g.{MIG_A100_MEM_UNITS[g] * A100_MEM_SLICE_GB}gb", id=_A100_IDS[g], slices=g,
               mem_mb=MIG_A100_MEM_UNITS[g] * A100_MEM_SLICE_GB * 1024, max_count=MIG_MAX_COUNT[g],
               placements=tuple((s, MIG_A100_MEM_UNITS[g]) for s in _A100_STARTS[g]))
    for g in sorted(MIG_MAX_COUNT, reverse=True))


def known_profiles(gpu_name: str) -> tuple[MigProfile, ...]:
    """Built-in profiles for a GPU whose NVML name says it is an A100 40GB (empty otherwise)."""
    return A100_40GB_PROFILES if "A100" in gpu_name and "40GB" in gpu_name.replace(" ", "") else ()


@dataclass(frozen=True)
class MigSlice:
    """One existing MIG device: what a worker's ``CUDA_VISIBLE_DEVICES`` names (``uuid``), the
    GPU and compute instance it is, its memory and slice counts (NVML's device attributes)
    and its profile's name (``"3g.20gb"``; ``"1c.3g.20gb"`` when the compute instance takes
    fewer slices than its GPU instance). ``placement`` is the GPU instance's (start, size) on
    the memory slices, None when NVML did not say."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    mem_bytes: int
    slices: int  # the GPU instance's compute slices
    compute_slices: int  # the compute instance's
    profile: str
    placement: tuple[int, int] | None = None

    @property
    def whole(self) -> bool:
        """The compute instance takes its whole GPU instance (what ``-cgi ... -C`` makes)."""
        return self.compute_slices == self.slices

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {"uuid": self.uuid, "gpu_instance": self.gpu_instance, "compute_instance": self.compute_instance,
                "mem_bytes": self.mem_bytes, "slices": self.slices, "compute_slices": self.compute_slices,
                "profile": self.profile, "placement": list(self.placement) if self.placement else None}


def slice_profile_name(gi_slices: int, ci_slices: int, mem_mb: int) -> str:
    """The profile name nvidia-smi shows for a MIG device: ``3g.20gb``, or ``1c.3g.20gb`` for
    a compute instance of 1 slice in a 3g GPU instance. Memory is rounded up to whole GB, as
    the names are (an A100's 1g has 4864 MiB and is called 1g.5gb)."""
    base = f"{gi_slices}g.{-(-mem_mb // 1024)}gb"
    return base if ci_slices == gi_slices else f"{ci_slices}c.{base}"


@dataclass(frozen=True)
class Gpu:
    """One GPU: a partition by itself, or (MIG on) the holder of ``slices``.

    ``mig`` and ``mig_pending`` are None for a GPU without MIG; ``profiles`` are the GPU
    instance profiles it offers (from NVML, else ``known_profiles``; empty when neither
    knows them), ``note`` says what could not be read."""

    index: int
    uuid: str
    name: str
    mem_bytes: int
    mig: bool | None
    mig_pending: bool | None
    slices: tuple[MigSlice, ...] = ()
    profiles: tuple[MigProfile, ...] = ()
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "mem_bytes": self.mem_bytes,
                "mig": self.mig, "mig_pending": self.mig_pending, "slices": [s.to_dict() for s in self.slices],
                "profiles": [p.to_dict() for p in self.profiles], "note": self.note}


@dataclass(frozen=True)
class GpuListing:
    """The node's GPUs, or why there are none to list (``reason``)."""

    gpus: tuple[Gpu, ...] = ()
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``GET /v2/partitions``' ``gpus``, ``splitserve gpus --json``)."""
        return {"gpus": [g.to_dict() for g in self.gpus], "reason": self.reason}

    def gpu(self, index: int) -> Gpu:
        """GPU ``index``, or InvalidInput naming the GPUs there are (or why there are none)."""
        for g in self.gpus:
            if g.index == index:
                return g
        if self.gpus:
            raise InvalidInput(f"no GPU {index} on this node (GPUs: {', '.join(str(g.index) for g in self.gpus)})")
        raise InvalidInput(f"no GPU {index} on this node: {self.reason or 'no GPUs'}")


# --------------------------------------------------------------------------- geometry


def parse_geometry(text: str, profiles: Sequence[MigProfile]) -> tuple[MigProfile, ...]:
    """The profiles a geometry names, largest first: each comma-separated item is a profile
    name (``3g.20gb``, ``MIG 3g.20gb``) or ``Ng``, the GPU's plain N-slice profile (the one
    of N slices with the least memory, as nvidia-smi lists it first)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InvalidInput(f"geometry {text!r} names no profile; write e.g. 4g,3g or 4g.20gb,3g.20gb")
    by_name = {p.name: p for p in profiles}
    out: list[MigProfile] = []
    for item in items:
        name = item.removeprefix("MIG ").strip().lower()
        if name in by_name:
            out.append(by_name[name])
            continue
        g = name.removesuffix("g")
        plain = sorted((p for p in profiles if g.isdigit() and p.slices == int(g) and "+" not in p.name),
                       key=lambda p: p.mem_mb)
        if not plain:
            raise InvalidInput(f"{item!r} is not a profile of this GPU; it has "
                               f"{', '.join(p.name for p in profiles) or 'none that NVML listed'}")
        out.append(plain[0])
    return tuple(sorted(out, key=lambda p: (-p.slices, -p.mem_mb, p.name)))


def _geometry_text(profiles: Sequence[MigProfile]) -> str:
    return ",".join(p.name for p in profiles)


def compute_slices(profiles: Sequence[MigProfile]) -> int:
    """A GPU's compute slices: its largest profile's (7 on an A100 or H100)."""
    return max((p.slices for p in profiles), default=COMPUTE_UNITS)


def check_geometry(gpu_name: str, wanted: Sequence[MigProfile],
                   profiles: Sequence[MigProfile]) -> list[tuple[int, int] | None]:
    """Refuse (InvalidInput, saying which rule) a geometry the GPU cannot hold: a profile
    more times than its count allows, more compute slices than the GPU has, or (placements
    known) no way to place every instance on the GPU's memory slices. Returns a placement
    per wanted instance, in order (None where the profile's placements are unknown)."""
    what = f"geometry {_geometry_text(wanted)} on {gpu_name}"
    for p, n in Counter(wanted).items():
        if n > p.max_count:
            raise InvalidInput(f"{what}: {n}× {p.name}, but the GPU holds at most {p.max_count}")
    total = compute_slices(profiles)
    used = sum(p.slices for p in wanted)
    if used > total:
        raise InvalidInput(f"{what}: needs {used} compute slices, the GPU has {total}")
    placed = _place(wanted, frozenset())
    if placed is None:
        raise InvalidInput(f"{what}: no placement of these instances fits the GPU's memory slices "
                           f"({sum(p.mem_mb for p in wanted)} MB asked)")
    return placed


def _place(wanted: Sequence[MigProfile], taken: frozenset[int]) -> list[tuple[int, int] | None] | None:
    """A placement of each wanted instance on memory slices not ``taken`` (depth-first:
    seven instances at most, a handful of placements each), or None when none exists."""
    if not wanted:
        return []
    first, rest = wanted[0], wanted[1:]
    if not first.placements:
        tail = _place(rest, taken)
        return None if tail is None else [None, *tail]
    for start, size in first.placements:
        cells = frozenset(range(start, start + size))
        if not cells & taken:
            tail = _place(rest, taken | cells)
            if tail is not None:
                return [(start, size), *tail]
    return None


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Command:
    """One step of a plan: the argv to run and why it is there."""

    argv: tuple[str, ...]
    why: str

    def __str__(self) -> str:
        return " ".join(self.argv)


@dataclass(frozen=True)
class MigPlan:
    """The commands that take GPU ``gpu`` from its layout to ``target``, in order, with the
    GPU instances kept as they are; ``notes`` say what the plan cannot do itself."""

    gpu: int
    gpu_name: str
    target: tuple[str, ...]
    commands: tuple[Command, ...]
    kept: tuple[int, ...] = ()  # GPU instance ids left as they are
    notes: tuple[str, ...] = ()
    # the partitions (MIG device or whole-GPU UUIDs) the plan takes away: their work must be
    # drained and their processes gone before it runs
    destroys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {"gpu": self.gpu, "gpu_name": self.gpu_name, "target": list(self.target), "kept": list(self.kept),
                "commands": [{"argv": list(c.argv), "why": c.why} for c in self.commands],
                "notes": list(self.notes), "destroys": list(self.destroys)}


def plan_geometry(gpu: Gpu, geometry: str) -> MigPlan:
    """The ``nvidia-smi`` commands that give ``gpu`` the MIG ``geometry``, in order: turn MIG
    mode on (and reset the GPU so it takes effect) if it is off; destroy the compute, then
    the GPU instances that the target does not keep; create the missing GPU instances with
    one full compute instance each (``-cgi ... -C``), largest first. GPU instances that
    already have a target profile and one full compute instance are kept, unless the target
    cannot be placed beside them: then everything is recreated. InvalidInput for a GPU
    without MIG, profiles nobody knows, or an impossible geometry."""
    i = str(gpu.index)
    if gpu.mig is None:
        raise InvalidInput(f"GPU {gpu.index} ({gpu.name}) does not support MIG")
    profiles = gpu.profiles or known_profiles(gpu.name)
    if not profiles:
        raise InvalidInput(f"GPU {gpu.index} ({gpu.name}): NVML lists no MIG profiles ({gpu.note or 'MIG is off'}) "
                           "and splitserve knows none for this GPU; turn MIG on (nvidia-smi -i "
                           f"{gpu.index} -mig 1, then reset the GPU) and plan again")
    wanted = parse_geometry(geometry, profiles)
    by_name = {p.name: p for p in profiles}
    target = tuple(p.name for p in wanted)
    commands: list[Command] = []
    notes: list[str] = []
    check_geometry(gpu.name, wanted, profiles)
    if not gpu.mig:
        if not gpu.mig_pending:
            commands.append(Command(("nvidia-smi", "-i", i, "-mig", "1"), "turn MIG mode on"))
        commands.append(Command(("nvidia-smi", "-i", i, "-r"),
                                "reset the GPU so MIG mode takes effect (no process may use it)"))
        notes.append("MIG mode changes need an idle GPU; where the reset is refused, reboot and plan again")
        return MigPlan(gpu.index, gpu.name, target, (*commands, *_creates(i, wanted)), (), tuple(notes),
                       (gpu.uuid,))  # the reset takes the whole GPU away from its workers
    by_gi = _instances(gpu)
    kept = _keep(by_gi, wanted, by_name)
    missing = _missing(wanted, [by_name[by_gi[g][0].profile] for g in kept])
    gone = sorted(g for g in by_gi if g not in kept)
    for g in gone:
        for s in sorted(by_gi[g], key=lambda s: s.compute_instance):
            commands.append(Command(("nvidia-smi", "mig", "-i", i, "-gi", str(g), "-ci", str(s.compute_instance),
                                     "-dci"), f"destroy compute instance {s.compute_instance} of GPU instance {g}"))
    for g in gone:
        commands.append(Command(("nvidia-smi", "mig", "-i", i, "-gi", str(g), "-dgi"),
                                f"destroy GPU instance {g} ({by_gi[g][0].profile})"))
    commands.extend(_creates(i, missing))
    if gone:
        notes.append("destroying an instance needs every process on it stopped: drain its workers first")
    if not commands:
        notes.append(f"GPU {gpu.index} already has geometry {_geometry_text(wanted)}")
    destroys = tuple(s.uuid for g in gone for s in sorted(by_gi[g], key=lambda s: s.compute_instance))
    return MigPlan(gpu.index, gpu.name, target, tuple(commands), tuple(sorted(kept)), tuple(notes), destroys)


def _creates(i: str, profiles: Sequence[MigProfile]) -> list[Command]:
    if not profiles:
        return []
    names = ",".join(p.name for p in profiles)
    return [Command(("nvidia-smi", "mig", "-i", i, "-cgi", names, "-C"),
                    f"create GPU instances {names}, each with one compute instance of all its slices")]


def _instances(gpu: Gpu) -> dict[int, list[MigSlice]]:
    """The GPU's MIG devices by GPU instance id."""
    out: dict[int, list[MigSlice]] = {}
    for s in gpu.slices:
        out.setdefault(s.gpu_instance, []).append(s)
    return out


def _missing(wanted: Sequence[MigProfile], kept: Sequence[MigProfile]) -> list[MigProfile]:
    """The wanted instances that kept ones do not already give, largest first."""
    out = list((Counter(wanted) - Counter(kept)).elements())
    return sorted(out, key=lambda p: (-p.slices, -p.mem_mb, p.name))


def _keep(by_gi: dict[int, list[MigSlice]], wanted: Sequence[MigProfile],
          by_name: dict[str, MigProfile]) -> set[int]:
    """The GPU instances a plan keeps: those with a wanted profile, one whole compute
    instance and a known placement, as many as the target has of each profile, when the rest
    of the target still fits beside them; else none (all recreated, largest first, which
    fits whenever the geometry itself does)."""
    left = Counter(p.name for p in wanted)
    kept: set[int] = set()
    for g, ss in sorted(by_gi.items()):
        s = ss[0]
        if len(ss) == 1 and s.whole and s.placement is not None and left[s.profile] > 0:
            left[s.profile] -= 1
            kept.add(g)
    taken = frozenset(c for g in kept for start, size in [by_gi[g][0].placement or (0, 0)]
                      for c in range(start, start + size))
    missing = _missing(wanted, [by_name[by_gi[g][0].profile] for g in kept])
    return kept if _place(missing, taken) is not None else set()


def plan_node_geometry(listing: GpuListing, units: Sequence[int]) -> tuple[list[MigPlan], list[str]]:
    """Algorithm 2's geometry (PROTEAN's partition sizes in "g" units, e.g. (4, 2, 1)) as the
    MIG plans that would give every MIG-capable GPU of the node that layout, and why each
    other GPU has none (no MIG, no profiles known, a geometry it cannot hold). Pure: the
    plans are carried out (or, without the administrator's flag, only logged) by
    ``placement.gpus.MigDriver.apply``."""
    text = ",".join(f"{u}g" for u in sorted(units, reverse=True))
    plans: list[MigPlan] = []
    skipped: list[str] = []
    for gpu in listing.gpus:
        if gpu.mig is None:
            skipped.append(f"GPU {gpu.index} ({gpu.name}) does not support MIG")
            continue
        try:
            plans.append(plan_geometry(gpu, text))
        except InvalidInput as e:
            skipped.append(str(e))
    return plans, skipped
