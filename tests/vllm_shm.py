"""Stale shared memory of vLLM's CPU backend: what a killed run leaves in /dev/shm.

vLLM-CPU's tensor-parallel all-reduce creates one POSIX shared-memory segment per rank, named
`{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}` (vllm/distributed/device_communicators/cpu_communicator.py);
under `external_launcher` the identifier is empty, so every run uses the same names (e.g. `-tp:0-[0-1]-cpushm_0`).
A run that exits removes them; a run killed with SIGKILL cannot, and the next run's `shm_open(O_CREAT | O_EXCL)` then
fails with `create shm in SHMManager failed. errno: 17` (EEXIST). `remove_stale()` deletes the segments that no
live process has mapped or open, so a segment of a run still going is never touched. Run as a script by
`make test-vllm` before its tests, and by tests/conftest.py before any test."""

import os, sys
from pathlib import Path

SHM = Path("/dev/shm")


def in_use(paths: list[Path]) -> set[Path]:
    "The ones among `paths` that some process maps (/proc/PID/maps) or holds open (/proc/PID/fd)."
    names, used = {str(p): p for p in paths}, set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            maps = (proc / "maps").read_text()
            used.update(p for n, p in names.items() if n in maps)
            for fd in (proc / "fd").iterdir():
                p = names.get(os.readlink(fd))
                if p is not None:
                    used.add(p)
        except OSError:
            continue  # a process that ended meanwhile, or one we may not read
    return used


def remove_stale(root: Path = SHM, log=print) -> list[Path]:
    "Delete vLLM-CPU segments (`*cpushm*`) under `root` that no live process uses; return what was removed."
    segs = sorted(root.glob("*cpushm*")) if root.is_dir() else []
    stale = [p for p in segs if p not in in_use(segs)]
    for p in stale:
        p.unlink(missing_ok=True)
        if log:
            log(f"removed stale vLLM-CPU shared memory {p} (left by a killed run)")
    return stale


if __name__ == "__main__":
    remove_stale()
    sys.exit(0)
