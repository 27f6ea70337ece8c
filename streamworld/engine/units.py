"""Units of work and their order inside a chunk.

A unit is `(stream, chunk, phase, stage)`. Phases: denoising step k (0..S-1), the `clean`
mode commit pass, and the first-image prefill (which the engine runs as chunk -1). Inside
one chunk the units run in a fixed linear order (all stages of step 0, then of step 1, ...,
then the commit pass), so a chunk's progress is one integer: how many of its units are done.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMIT = -1  # phase of the clean-mode commit pass
PREFILL = -2  # phase of the first-image prefill (chunk -1)
PREFILL_CHUNK = -1


@dataclass(frozen=True)
class WorkUnit:
    stream: int
    chunk: int
    phase: int  # a denoising step k >= 0, COMMIT or PREFILL
    stage: int

    def __str__(self) -> str:
        phase = {COMMIT: "commit", PREFILL: "prefill"}.get(self.phase, f"step{self.phase}")
        return f"s{self.stream}/c{self.chunk}/{phase}/g{self.stage}"


def chunk_phases(kv_mode: str, num_steps: int) -> list[int]:
    """Phases of a generated chunk in execution order."""
    return list(range(num_steps)) + ([COMMIT] if kv_mode == "clean" else [])


def unit_index(phases: list[int], phase: int, stage: int, num_stages: int) -> int:
    """Position of (phase, stage) in a chunk's linear order."""
    return phases.index(phase) * num_stages + stage


def context_dependency(kv_mode: str, phase: int, num_steps: int) -> int:
    """The phase of the previous chunk whose K/V (at the same stage) a unit reads.

    noisy: step k reads what the previous chunk wrote at step k; final: what it wrote at its
    last step; clean: what its commit pass wrote. The commit pass reads what the steps read.
    """
    if kv_mode == "noisy":
        return phase
    if kv_mode == "final":
        return num_steps - 1
    return COMMIT
