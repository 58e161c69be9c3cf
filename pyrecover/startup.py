"""What shortens a trainer's start: the garbage collector off while torch is imported (see
pyrecover/__main__.py).

torch._dynamo (which torch's first Optimizer imports, 1.7-4 s here) was once imported in a
background thread to overlap the start-up's waits. Python's per-module import locks made
that unsafe: a main thread importing a module torch._dynamo also imports, while the thread
held torch._dynamo's lock, failed with `_DeadlockError` (seen once in a full test run, in a
compiled run's start). Measured on the 2-core VM it saved next to nothing (the time moved to
the rendezvous), so it is gone."""

from __future__ import annotations

import gc


def end_startup_imports() -> None:
    """end_startup_imports turns the garbage collector back on where `python -m pyrecover
    train` left it off for the start-up's imports (pyrecover/__main__.py), once the last of
    them (torch._dynamo, for the optimizer) is done and before anything that makes cyclic
    garbage in bulk (torch.compile at the first step). What the imports allocated is frozen
    out of later collections, which would walk it all again (the exit's gc.collect did, for
    0.15-0.44 s)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
