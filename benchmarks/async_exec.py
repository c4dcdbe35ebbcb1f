#!/usr/bin/python3
"""1,000 concurrent execs from one asyncio loop (dsec.AsyncClient) against the sync client driving the same 1,000
execs from a ThreadPoolExecutor of 64 workers, on one embedded agent with a few busybox sandboxes.

    PYTHONPATH=build/python DSEC_HOME=$PWD/build/test-home /usr/bin/python3 benchmarks/async_exec.py [--execs N]

Reports, for each client: wall time, execs per second, the peak thread count of this process (/proc/self/status,
native threads included) and the process's CPU time (user + system, resource.getrusage) spent on the run. The
agent runs in its own process, so its CPU is not counted. $DSEC_HOME must hold a busybox image (scripts/test.sh
builds one in build/test-home).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import resource
import threading
import time

import dsec


def threads_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


class Meter:
    """Wall time, this process's CPU time and its peak thread count over a block."""

    def __enter__(self) -> "Meter":
        self.peak = threads_now()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, daemon=True)
        self._watch.start()
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._t = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, threads_now())

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu = (ru.ru_utime - self._ru.ru_utime) + (ru.ru_stime - self._ru.ru_stime)
        self._stop.set()
        self._watch.join()
        self.peak -= 1  # the sampling thread itself


def run_async(client: dsec.AsyncClient, ids: list[str], n: int) -> Meter:
    async def main() -> None:
        sbs = [client.attach(i) for i in ids]
        results = await asyncio.gather(*(sbs[k % len(sbs)].exec("true") for k in range(n)))
        assert all(r.exit_code == 0 for r in results)

    with Meter() as m:
        asyncio.run(main())
    return m


def run_threads(client: dsec.Client, ids: list[str], n: int, workers: int) -> Meter:
    sbs = [client.attach(i) for i in ids]
    with Meter() as m:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda k: sbs[k % len(sbs)].exec("true"), range(n)))
        assert all(r.exit_code == 0 for r in results)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--execs", type=int, default=1000)
    ap.add_argument("--sandboxes", type=int, default=4)
    ap.add_argument("--workers", type=int, default=64, help="threads of the sync client's pool")
    ap.add_argument("--rounds", type=int, default=2, help="each client runs this many times; the best is kept")
    args = ap.parse_args()

    client = dsec.AsyncClient()
    try:
        sync = client.sync  # the same agent and node table
        sbs = sync.create_many(args.sandboxes, image="busybox", ttl=600, memory="256Mi", pids=1024)
        ids = [s.id for s in sbs]
        run_async(client, ids, 50)  # warm both paths' connections
        run_threads(sync, ids, 50, args.workers)
        rows = []
        for label, fn in (("asyncio (AsyncClient, one loop)", lambda: run_async(client, ids, args.execs)),
                          (f"sync Client + {args.workers} threads", lambda: run_threads(sync, ids, args.execs,
                                                                                          args.workers))):
            best = min((fn() for _ in range(args.rounds)), key=lambda m: m.cpu)
            rows.append((label, best))
        print(f"{args.execs} concurrent exec('true') over {len(ids)} busybox sandboxes, one embedded agent")
        print(f"{'client':36} {'wall s':>8} {'execs/s':>9} {'CPU s':>7} {'peak threads':>13}")
        for label, m in rows:
            print(f"{label:36} {m.wall:8.2f} {args.execs / m.wall:9.0f} {m.cpu:7.2f} {m.peak:13d}")
        a, s = rows[0][1], rows[1][1]
        print(f"asyncio CPU / threaded CPU: {a.cpu / s.cpu:.2f}")
        for s in sbs:
            s.destroy()
    finally:
        client.close_now()


if __name__ == "__main__":
    main()
