"""Placement: which devices one served model uses, and how (plain data, no torch).

A `Placement` is a list of replicas. Each replica is one engine with its own weights, K/V
pages, executors and decoder; a session lives on one replica for its whole life. A replica
runs the DiT's blocks as one or more contiguous stages, each on a device and a virtual rank
(a worker thread, and a CUDA stream on a GPU); several stages may share a device.

The command line builds one from `--devices` and `--placement` (`parse_placement`); a
deployment file will carry the same structure. The forms of `--placement`:

    replicas              one replica per device, each running every block (the default)
    pipeline              one replica whose blocks are split evenly over the devices, in order
    0-13@cuda:0,14-29@cuda:1
                          an explicit stage map: block ranges (inclusive) on devices, in
                          block order, covering every block once; `decode@DEVICE` places the
                          decoder (default: the last stage's device)
    MAP|MAP               several replicas, each an explicit stage map

`--stages N` splits each replica of `replicas` into N stages on its device (virtual ranks),
and sets how many stages `pipeline` makes (default: one per device, placed in order).
Everything is checked here against the model's block count; `check_devices` checks that the
devices exist. Each error is one line that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .kv_pool import split_stages


class PlacementError(ValueError):
    """A placement that cannot work; the message is one line for the user."""


@dataclass(frozen=True)
class StagePlacement:
    start: int  # first block
    stop: int  # one past the last block
    device: str
    rank: int  # the virtual rank (executor) that runs this stage, within its replica

    @property
    def blocks(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ReplicaPlacement:
    stages: tuple[StagePlacement, ...]
    decoder_device: str
    # Ranks the replica has; None: as many as its stages name. More than that leaves ranks
    # with no stage (`--ranks` above `--stages` on one device, as before placements).
    ranks: int | None = None

    @property
    def home_device(self) -> str:
        """Where the first stage, the text encoder and input preparation run."""
        return self.stages[0].device

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device the replica uses, first use first."""
        seen = [s.device for s in self.stages] + [self.decoder_device]
        return tuple(dict.fromkeys(seen))

    @property
    def num_ranks(self) -> int:
        return max(self.ranks or 0, 1 + max(s.rank for s in self.stages))

    def describe(self) -> str:
        stages = ",".join(f"{s.start}-{s.stop - 1}@{s.device}" for s in self.stages)
        return f"{stages},decode@{self.decoder_device}"


@dataclass(frozen=True)
class Placement:
    replicas: tuple[ReplicaPlacement, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d for r in self.replicas for d in r.devices))

    def describe(self) -> str:
        return " | ".join(r.describe() for r in self.replicas)


def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges of nearly equal size covering [0, num_blocks)."""
    if parts > num_blocks:
        raise PlacementError(f"{parts} stages but the model has only {num_blocks} blocks")
    return [(s.start, s.stop) for s in split_stages(num_blocks, parts)]


def single_device(device: str, num_blocks: int, stages: int = 1, ranks: int = 1) -> Placement:
    """One replica on one device: `stages` stages, stage g on rank g % ranks (the engine's
    arrangement before placements existed)."""
    if stages < 1 or ranks < 1:
        raise PlacementError("--stages and --ranks must be at least 1")
    ranges = split_blocks(num_blocks, stages)
    staged = tuple(StagePlacement(a, b, device, g % ranks) for g, (a, b) in enumerate(ranges))
    return Placement((ReplicaPlacement(staged, device, ranks),))


def parse_placement(
    spec: str, devices: Sequence[str], num_blocks: int, stages: int | None = None
) -> Placement:
    """The placement of `--placement spec` over `--devices`, for a model of `num_blocks`."""
    spec = spec.strip()
    devices = [d.strip() for d in devices if d.strip()]
    if spec == "replicas":
        if not devices:
            raise PlacementError("--placement replicas needs at least one device in --devices")
        n = stages or 1  # a device named twice holds two replicas that time-share it
        return Placement(tuple(single_device(d, num_blocks, n, n).replicas[0] for d in devices))
    if spec == "pipeline":
        if not devices:
            raise PlacementError("--placement pipeline needs at least one device in --devices")
        n = stages or len(devices)
        if n < len(devices):
            raise PlacementError(f"--stages {n} is fewer than the {len(devices)} devices of the pipeline")
        ranges = split_blocks(num_blocks, n)
        # Stages go to the devices in order, as evenly as the counts allow.
        owner = [devices[g * len(devices) // n] for g in range(n)]
        staged = tuple(StagePlacement(a, b, owner[g], g) for g, (a, b) in enumerate(ranges))
        return Placement((ReplicaPlacement(staged, staged[-1].device),))
    if not spec:
        raise PlacementError("--placement is empty")
    return Placement(tuple(_parse_map(part, num_blocks) for part in spec.split("|")))


def _parse_map(text: str, num_blocks: int) -> ReplicaPlacement:
    stages: list[StagePlacement] = []
    decoder: str | None = None
    for entry in (e.strip() for e in text.split(",")):
        what, at, device = entry.partition("@")
        if not at or not device.strip():
            raise PlacementError(f"--placement entry {entry!r} must look like 0-13@cuda:0 or decode@cuda:0")
        device = device.strip()
        if what.strip() == "decode":
            if decoder is not None:
                raise PlacementError("--placement places the decoder twice")
            decoder = device
            continue
        first, dash, last = what.strip().partition("-")
        if not (dash and first.isdigit() and last.isdigit()):
            raise PlacementError(f"--placement entry {entry!r}: blocks must be a range like 0-13")
        a, b = int(first), int(last) + 1
        expected = stages[-1].stop if stages else 0
        if a != expected:
            what_is = "skips" if a > expected else "repeats"
            raise PlacementError(
                f"--placement {what_is} blocks: {entry!r} starts at {a}, expected {expected}"
            )
        if b <= a:
            raise PlacementError(f"--placement entry {entry!r} is an empty block range")
        if b > num_blocks:
            raise PlacementError(f"--placement entry {entry!r} goes past the model's {num_blocks} blocks")
        stages.append(StagePlacement(a, b, device, len(stages)))
    if not stages:
        raise PlacementError(f"--placement {text!r} places no blocks")
    if stages[-1].stop != num_blocks:
        raise PlacementError(
            f"--placement leaves blocks {stages[-1].stop}-{num_blocks - 1} unplaced"
            f" (the model has {num_blocks})"
        )
    return ReplicaPlacement(tuple(stages), decoder or stages[-1].device)


def check_devices(placement: Placement, exists: Callable[[str], str | None]) -> None:
    """Raises on the first device that `exists` rejects (it returns why, or None if fine)."""
    for device in placement.devices:
        problem = exists(device)
        if problem is not None:
            raise PlacementError(f"device {device!r}: {problem}")
