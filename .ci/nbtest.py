"""`make nbtest`: every notebook top to bottom as nbdev_test runs it, each in a fresh process (`.ci/nbcheck.py`: it
also checks that every cell's saved output is what the cell shows now), `os.cpu_count()` at a time.

nbdev_test's own pool reuses worker processes across notebooks, so one notebook's global state (a DeepSpeed ZeRO-3
config that transformers keeps a reference to, torch's thread settings, a process group) can reach the next one;
a process per notebook cannot leak. Each notebook's process is forked from this one after it has imported torch and
transformers (and run no notebook code): about 5 s of imports per notebook, paid once (a fork server, as
tests/cli_server.py is for the command lines). This process stays single-threaded, so a fork copies no lock another
thread holds. Each notebook runs on one thread (OMP_NUM_THREADS=1, set before torch is imported): two notebooks on
two cores without oversubscription. The longest notebooks start first. Prints one line per notebook, then the timing
table (slowest first); exits 1 if any notebook failed. Arguments are passed to nbcheck (`--write`: save fresh
outputs)."""

import json, os, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def weight(nb: Path) -> int:
    "Rough cost, to start the long ones first: code characters outside cells nbdev_test skips (slow, gpu, notest)."
    cells = json.loads(nb.read_text())["cells"]
    skip = ("#| slow", "#| gpu", "#| notest", "#| eval: false")
    return sum(
        len("".join(c["source"]))
        for c in cells
        if c["cell_type"] == "code" and not any(f in "".join(c["source"])[:200] for f in skip)
    )


def preload():
    "What most notebooks import, imported once here before the forks (no threads are started by importing them)."
    os.environ.update(ENV)
    import torch, transformers, execnb.shell, nbdev.config  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM  # noqa: F401  (lazy modules)

    sys.path.insert(0, str(ROOT / ".ci"))
    import nbcheck  # noqa: F401


def start(nb: Path, extra: list[str]) -> tuple[int, Path, float, str]:
    "Fork a child that runs nbcheck on `nb` with its output in a temporary file: (pid, notebook, start time, file)."
    fd, log = tempfile.mkstemp(prefix=f"nbtest-{nb.stem}-", suffix=".log")
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: its own stdout/stderr (fresh file objects), the notebook, then exit without cleanup
        rc = 1
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.chdir(ROOT)
            import nbcheck

            rc = nbcheck.main([str(nb), *extra])
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc if isinstance(rc, int) else 1)
    os.close(fd)
    return pid, nb, t0, log


def main(argv: list[str]) -> int:
    nbs = sorted((ROOT / "nbs").glob("*.ipynb"), key=weight, reverse=True)
    preload()
    t0, todo, running, results = time.perf_counter(), list(nbs), {}, []
    while todo or running:
        while todo and len(running) < (os.cpu_count() or 1):
            pid, nb, t, log = start(todo.pop(0), argv)
            running[pid] = (nb, t, log)
        pid, status = os.wait()
        if pid not in running:
            continue
        nb, t, log = running.pop(pid)
        dt, ok = time.perf_counter() - t, os.waitstatus_to_exitcode(status) == 0
        out = Path(log).read_text(errors="replace")
        os.unlink(log)
        print(f"{'ok  ' if ok else 'FAIL'} {nb.name} {dt:5.1f} s", flush=True)
        results.append((nb, ok, dt, out))
    failed = [r for r in results if not r[1]]
    for nb, _, _, out in failed:
        print(f"\n===== {nb.name} failed =====\n{out[-6000:]}", file=sys.stderr)
    print(
        f"\nnbtest: {len(results) - len(failed)} of {len(results)} notebooks passed in {time.perf_counter() - t0:.0f} s "
        f"({os.cpu_count()} at a time); seconds per notebook (its own forked process, one thread):"
    )
    for nb, ok, dt, _ in sorted(results, key=lambda r: -r[2]):
        print(f"  {dt:6.1f}  {nb.name}{'' if ok else '  FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
