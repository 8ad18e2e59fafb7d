"""What a fresh trial worker costs to start, by start method.

Every trial runs in a fresh process (``search/execution/isolation.py``). This times, for each start
method, the moment ``Process.start()`` is called until the new process has what a trial worker
imports (``search.execution.worker``, and with it torch, numpy, scipy and Hydra), has built a torch
optimizer (the first one imports ``torch._dynamo``, as every trial's does) and answers through a
pipe:

* ``spawn``: a new interpreter that imports everything itself;
* ``forkserver``: forked from a server that imported it once (``search.execution._fork_server``, as
  ``isolation.worker_context`` starts it); the server's own start, paid once per study process, is
  reported apart.

A worker reused across trials would cost nothing to start, but reads CPU peak memory far too low
(see docs/method/measuring.md), so it is not an option here.

    python benchmarks/worker_start.py --starts 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _child(connection) -> None:
    import torch

    import search.execution.worker  # noqa: F401  (what every trial worker imports)

    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # as every trial builds one
    connection.send(time.perf_counter())
    connection.close()


def _start_once(context) -> float:
    receive, send = context.Pipe(duplex=False)
    started = time.perf_counter()
    process = context.Process(target=_child, args=(send,))
    process.start()
    send.close()
    answered = receive.recv()
    process.join()
    return answered - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=8, help="worker starts timed per method")
    args = parser.parse_args()
    for method in ("spawn", "forkserver"):
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload(["search.execution._fork_server"])
            server_s = _start_once(context)
            print(f"forkserver: the server's own start (once per study process): {server_s:.2f} s")
        times = [_start_once(context) for _ in range(args.starts)]
        print(
            f"{method}: median {statistics.median(times):.3f} s per worker "
            f"(min {min(times):.3f}, max {max(times):.3f}, {args.starts} starts)"
        )


if __name__ == "__main__":
    main()
