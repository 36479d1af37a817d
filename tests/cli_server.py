"""Run command-line cases in forked children of one process that imported the commands once (tests/test_bad_input.py).

A console script (`dapo-train`, ...) is `sys.exit(main())` after importing its module; starting one costs 2-6 s of
imports (torch, transformers, DeepSpeed for dapo-ablate) before the command reads its first argument. This server
imports the commands' modules once, then for each request forks a child that does what the console script does:
sets the environment, the working directory and `sys.argv`, calls `main()`, prints an uncaught exception's traceback
to stderr as the interpreter would, and exits with `main()`'s status. The child's stdout and stderr go to files the
request names. What differs from a fresh process is only that the imports happened earlier (with the same
environment); test_bad_input.py still starts every command once as its real console script.

Protocol: one JSON request per line on stdin, {"prog", "argv", "cwd", "env", "stdout", "stderr"}; one JSON reply per
line on stdout, {"rc"} (a signal: -signum). EOF on stdin ends the server.
"""

import importlib, json, os, signal, sys, traceback

MODULES = {
    "dapo-train": "dapo_ref.train",
    "dapo-eval": "dapo_ref.eval_cli",
    "dapo-plan": "dapo_ref.plan",
    "dapo-ablate": "dapo_ref.ablate",
    "dapo-export": "dapo_ref.checkpoints:export_main",
    "dapo-tiny": "dapo_ref.tiny_ship",
}  # module[:function], else main


def child(main, req: dict) -> int:
    "In the forked child: the console script's `sys.exit(main())`, its output in the request's files."
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = [req["prog"], *req["argv"]]
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1  # sys.exit("message")
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve():
    reply = os.fdopen(os.dup(1), "w")  # the replies; fd 1 itself: stderr (an import that prints cannot garble them)
    os.dup2(2, 1)
    mods = {}
    for prog, spec in MODULES.items():
        mod, _, fn = spec.partition(":")
        mods[prog] = getattr(importlib.import_module(mod), fn or "main")
    reply.write(json.dumps({"ready": sorted(mods)}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here is inherited by the child
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(mods[req["prog"]], req)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    serve()
