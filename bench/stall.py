"""How long one heavy request holds up everyone else: against a `kiln serve` it starts, a poller
asks GET /health every 50 ms and a client streams a completion, while the heavy requests of
issue 33's table (tests/stall_watch.py) go in one at a time. Prints each request's status and
time, the worst /health answer and the worst gap between stream chunks meanwhile.

    .venv/bin/python bench/stall.py [--only TEXT] [-- extra kiln serve flags]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from api_server import KilnServer  # noqa: E402
from stall_watch import Watch, heavy_requests, post  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", default="", help="the requests whose label holds this text")
    p.add_argument("serve_args", nargs="*")
    args = p.parse_args()
    with KilnServer(Path(tempfile.mkdtemp()), *args.serve_args) as server:
        print("| request | status | time (s) | /health worst (s) | stream gap worst (s) |")
        print("|---|---|---|---|---|")
        for heavy in heavy_requests():
            if args.only not in heavy.label:
                continue
            with Watch(server.url) as watch:
                t0 = time.perf_counter()
                r = post(server.url, heavy)
                took = time.perf_counter() - t0
                time.sleep(0.3)
            print(f"| {heavy.label} | {r.status_code} | {took:.2f} | {watch.worst_health:.2f} | "
                  f"{watch.worst_gap:.2f} |", flush=True)
        deadline = time.monotonic() + 10  # the watcher's last stream is being aborted
        while (health := server.health())["kv_free_blocks"] < health["kv_total_blocks"] \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"\nafter: in_flight {health['in_flight']}, KV blocks free "
              f"{health['kv_free_blocks']}/{health['kv_total_blocks']}")


if __name__ == "__main__":
    main()
