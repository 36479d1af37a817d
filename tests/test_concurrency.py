"""Two processes on one run folder or one result file, through the real command line (nbs/00c_one_writer.ipynb).

On a cluster a requeued job can start while the old one still runs, and two evaluations can be pointed at one file.
Each test starts the commands as real processes at the same moment (or one while the other runs) and checks that
exactly one writes, the other says so in one line, and nothing either of them wrote is lost or mixed. The same
refusals with a stand-in holder, one process at a time, are cases of tests/test_bad_input.py (`train-live-run*`).
"""

import json, os, signal, subprocess, time
from pathlib import Path

import pytest


from test_bad_input import ENV, command, jsonl_rows

ROOT = Path(__file__).resolve().parents[1]
FAST = ["eval_every=0", "val_before_train=false", "prompts_per_step=2", "gen_batch_size=4", "mini_batch_size=16"]


def train(out: Path, *extra: str) -> subprocess.Popen:
    "dapo-train on the tiny task into `out`, started now (stdout and stderr captured)."
    argv = ["--config", "recipes/tiny-cpu.yaml", f"output_dir={out}", *FAST, *extra]
    return subprocess.Popen(
        command("dapo-train") + argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)  # hang guard
    return p.returncode, out, err


def error_lines(err: str, prog: str = "dapo-train") -> list[str]:
    assert "Traceback" not in err, err[-3000:]
    return [l for l in err.splitlines() if l.startswith(f"{prog}: error: ")]


def steps(run: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def test_two_starts_into_one_new_folder(tmp_path):
    """Both started at once into the same new output_dir: one trains it to the end, the other stops in one line
    (the lock's holder named, or, if it came after the first had finished, the run it would replace)."""
    out = tmp_path / "run"
    a, b = train(out, "total_steps=2"), train(out, "total_steps=2")
    (ra, _, ea), (rb, _, eb) = finish(a), finish(b)
    assert sorted([ra, rb]) == [0, 2], (ra, ea[-2000:], rb, eb[-2000:])
    loser = ea if ra else eb
    line = error_lines(loser)
    assert len(line) == 1 and ("is being written by another run" in line[0] or "already holds a run" in line[0]), loser
    assert steps(out) == [0, 1, 2] and not (out / ".dapo_ref.lock").exists()  # one run's rows, once each; lock gone


def test_a_live_run_refuses_a_second_and_its_stale_lock_is_taken_over(tmp_path):
    """A run trains; `--resume` on it is refused in one line naming its PID (before, both trained to the end and
    metrics.jsonl held steps twice). The run is killed (SIGKILL: its lock stays); `--resume` then tells that the
    holder is gone, takes the lock over, and continues from the newest checkpoint: every step once in metrics.jsonl."""
    out = tmp_path / "run"
    live = train(out, "total_steps=100000", "save_every=1")
    deadline = time.monotonic() + 240  # hang guard
    while not (out / "checkpoints" / "step-2").is_dir():
        assert live.poll() is None and time.monotonic() < deadline, live.communicate()[1][-3000:]
        time.sleep(0.2)
    rc, _, err = finish(train(out, "--resume", "total_steps=100000", "save_every=1"))
    line = error_lines(err)
    assert rc == 2 and len(line) == 1 and f"being written by another run (PID {live.pid} on this host" in line[0], err
    live.send_signal(signal.SIGKILL)
    live.wait()
    assert (out / ".dapo_ref.lock").exists()  # a killed holder cannot remove its lock
    last = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit())
    rc, stdout, err = finish(train(out, "--resume", f"total_steps={last + 1}", "save_every=1"))
    assert rc == 0, err[-3000:]
    assert f"PID {live.pid}" in stdout and "no longer running; taken over" in stdout, stdout
    assert steps(out) == list(range(last + 2)), steps(out)  # 0..last+1, each once
    assert not (out / ".dapo_ref.lock").exists()


def test_two_evaluations_on_one_new_out(tmp_path):
    """Two dapo-eval with the same new --out at once: the file holds one evaluation's results, whole; the other
    evaluation either stopped at its start (the file existed) or, having run, says so and keeps its results beside."""
    res, data = tmp_path / "results.json", tmp_path / "problems.jsonl"
    data.write_text(jsonl_rows([(f"What is {i} + 1?", i + 1) for i in range(4)]))
    argv = ["--model", "tiny", "--data", str(data), "--k", "1", "--max-tokens", "8", "--out", str(res)]
    ps = [
        subprocess.Popen(
            command("dapo-eval") + argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    done = [finish(p) for p in ps]
    rcs = sorted(rc for rc, _, _ in done)
    assert rcs[0] == 0 and rcs[1] in (1, 2), [(rc, err[-1500:]) for rc, _, err in done]
    rc, _, err = next(d for d in done if d[0])
    line = error_lines(err, "dapo-eval")
    assert len(line) == 1, err
    assert json.loads(res.read_text())["n_prompts"] == 4  # whole
    if rc == 1:  # it ran to the end: its results are kept beside, whole
        kept = Path(line[0].rsplit(" ", 1)[1])
        assert "written by another process" in line[0] and json.loads(kept.read_text())["n_prompts"] == 4
    else:
        assert "already exists" in line[0]


def test_a_lock_or_marker_being_written_is_not_a_users_file(tmp_path):
    """Another rank checks the run folder (`check_owned`, in `prepare_output_dir`) while rank 0 takes the run lock:
    `write_whole` holds a temporary file beside the lock (`..dapo_ref.lock.<random>.tmp`) until it is linked and
    fsynced, and that file is not the user's. Before, it was taken for one, and rank 1 exited 2 alone (seen in two CI
    runs of 2-rank launches: `test_export_that_fails_midway_on_rank_0_stops_both_ranks`). The marker's the same."""
    import tempfile
    from dapo_ref.core import InputError
    from dapo_ref.runs import MARKER, check_owned
    from dapo_ref.writers import LOCK

    for name, d in ((LOCK, tmp_path / "lock"), (MARKER, tmp_path / "marker")):
        d.mkdir()
        fd, _ = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".tmp")  # as write_whole names it
        os.close(fd)
        assert check_owned(d, "run", "output_dir") is None
    (tmp_path / "lock" / "notes.txt").write_text("mine")  # a user's file beside it is still refused
    with pytest.raises(InputError, match="notes.txt"):
        check_owned(tmp_path / "lock", "run", "output_dir")
