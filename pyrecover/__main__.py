import gc
import sys

# `pyrecover train` imports torch, and torch._dynamo for the optimizer, at every start and
# restart: millions of objects, which the cyclic garbage collector walked again and again,
# 15-20% of that CPU time on the 2-core VM (2.4-2.6 s -> 2.05-2.13 s for torch + dynamo).
# The trainer turns it back on once the optimizer is built (startup.end_startup_imports).
if sys.argv[1:2] == ["train"]:
    gc.disable()
    from pyrecover import preempt  # the standard library only

    preempt.catch_early()  # a stop signal during start-up is a clean stop (preempt.py)

from pyrecover.cli import main  # noqa: E402

main()
