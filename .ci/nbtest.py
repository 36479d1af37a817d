"""`make nbtest`: every notebook top to bottom as nbdev_test runs it, each in a fresh process (`.ci/nbcheck.py`: it
also checks that every cell's saved output is what the cell shows now), `os.cpu_count()` at a time.

nbdev_test's own pool reuses worker processes across notebooks, so one notebook's global state (a DeepSpeed ZeRO-3
config that transformers keeps a reference to, torch's thread settings, a process group) can reach the next one;
a process per notebook cannot leak. Each notebook runs on one thread (OMP_NUM_THREADS=1): two notebooks on two cores
without oversubscription. The longest notebooks start first. Prints one line per notebook, then the timing table
(slowest first); exits 1 if any notebook failed. Arguments are passed to nbcheck (`--write`: save fresh outputs)."""
import json, os, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def weight(nb: Path) -> int:
    "Rough cost, to start the long ones first: code characters outside cells nbdev_test skips (slow, gpu, notest)."
    cells = json.loads(nb.read_text())["cells"]
    skip = ("#| slow", "#| gpu", "#| notest", "#| eval: false")
    return sum(len("".join(c["source"])) for c in cells if c["cell_type"] == "code" and
               not any(f in "".join(c["source"])[:200] for f in skip))


def run(nb: Path, extra: list[str]) -> tuple[Path, bool, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(ROOT / ".ci" / "nbcheck.py"), str(nb), *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    ok = p.returncode == 0
    print(f"{'ok  ' if ok else 'FAIL'} {nb.name} {dt:5.1f} s", flush=True)
    return nb, ok, dt, p.stdout + p.stderr


def main(argv: list[str]) -> int:
    nbs = sorted((ROOT / "nbs").glob("*.ipynb"), key=weight, reverse=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as ex:
        results = list(ex.map(lambda nb: run(nb, argv), nbs))
    failed = [r for r in results if not r[1]]
    for nb, _, _, out in failed: print(f"\n===== {nb.name} failed =====\n{out[-6000:]}", file=sys.stderr)
    print(f"\nnbtest: {len(results) - len(failed)} of {len(results)} notebooks passed in {time.perf_counter() - t0:.0f} s "
          f"({os.cpu_count()} at a time); seconds per notebook (its own process, one thread):")
    for nb, ok, dt, _ in sorted(results, key=lambda r: -r[2]): print(f"  {dt:6.1f}  {nb.name}{'' if ok else '  FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
