"""A file of torch.compile's compiled code, carried from one process or machine to the next.

torch.compile keeps what it compiles in a cache folder on the machine (Inductor's), so a
second run there compiles less. A machine that starts empty (a cloud job, a rented GPU,
CI) loses that folder with it. `save` writes the process's compiled artifacts (Inductor's
compiled graphs and kernels among them) to one file with
`torch.compiler.save_cache_artifacts`; `load`, in a later process, hands them back to
torch before it compiles, and the same graphs then come from the cache instead of being
compiled again. The artifacts are keyed by what compiled them (the graph, the PyTorch and
Triton versions, the device), so a file from another setup is read and simply not used.

The file holds pickled objects and compiled code: loading one runs what it holds. Load
only a file you made (`docs/security.md`).
"""

from __future__ import annotations

from pathlib import Path

# A larger file is refused before it is read: the artifacts of the models here are a few MB.
MAX_BYTES = 1 << 30


def load(path: str | Path) -> int | None:
    """Hand the artifacts saved at `path` to torch.compile: the bytes read, or None where
    there is no file yet (the first run) or it could not be read as artifacts (then
    everything compiles as without it, and `save` replaces it). A file over `MAX_BYTES` is
    refused with ValueError before it is read."""
    import torch

    path = Path(path)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{path} is {size} bytes, over the {MAX_BYTES} a compile cache may have")
    data = path.read_bytes()
    if torch.compiler.load_cache_artifacts(data) is None:  # torch logs why
        return None
    return len(data)


def save(path: str | Path) -> int | None:
    """Write the artifacts this process compiled or loaded to `path` (whole or not at all):
    the bytes written, or None where nothing was compiled (the file is left as it was)."""
    import torch

    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return None
    data = artifacts[0]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)
