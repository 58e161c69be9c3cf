import gc
import sys

try:
    # `pyrecover train` imports torch, and torch._dynamo for the optimizer, at every start and
    # restart: millions of objects, which the cyclic garbage collector walked again and again,
    # 15-20% of that CPU time on the 2-core VM (2.4-2.6 s -> 2.05-2.13 s for torch + dynamo).
    # The trainer turns it back on once the optimizer is built (startup.end_startup_imports).
    if sys.argv[1:2] == ["train"]:
        gc.disable()
        from pyrecover import preempt  # the standard library only

        preempt.catch_early()  # a stop signal during start-up is a clean stop (preempt.py)
    from pyrecover.cli import main
except KeyboardInterrupt:  # a Ctrl-C this early quits at once, as typer's own does: no trace
    sys.exit(130)
except ModuleNotFoundError as missing:  # run from a source tree over a Python without them
    top = (missing.name or "").split(".")[0]  # (`make gpu-check` where pip could not install)
    if not top or top == "pyrecover":
        raise
    print(f"error: {missing}: {sys.executable} lacks pyrecover's dependencies; install them "
          f"with `{sys.executable} -m pip install -e .` (a torch already installed in range "
          "is kept)", file=sys.stderr)
    sys.exit(2)

main()
