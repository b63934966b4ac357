"""What streaming tokens costs a node's scheduler thread: its step stretched by the event loop's work.

Run: `python -m bench.stream_overhead [--quick] [--out PATH]` (CPU; no model). A stand-in scheduler
thread runs "steps": it sleeps for the device step with the GIL released, as it does waiting for a
GPU, then publishes one token to every running request through the node's real path
(`ThreadedIO.publish` -> `RequestStream`), while an event loop thread turns each stream's updates
into protobuf responses and spends `--message-us` more per message standing in for the gRPC write.
Per setting it reports the step's wall time against the device step, the time publishing takes, and
the messages per stream (below the steps when updates that queued up went out as one message).
Settings: the hand-over (`batched`: a step's updates reach the loop in one wake-up, the node's path;
`per_update`: one `call_soon_threadsafe` per update, the node's former path) by GIL switch interval,
streams and loop cost per message; with `--stream-intervals 1,4`, each of those again at every
`--stream-interval` (tokens a message after a stream's first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import write_report
from bench.engine_cpu import _loadavg, _nproc
from engine.core import Req, SamplingParams
from engine.loop import ThreadedIO
from engine.scheduler import RequestUpdate
from engine.service.stream import RequestStream, set_stream_interval

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "stream_overhead.json"
HANDOVERS = ("batched", "per_update")


def _busy(seconds: float) -> None:
    """Hold the GIL this long, as the gRPC write path's Python does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _consume(stream: RequestStream, message_s: float, counts: list[int]) -> None:
    async for resp in stream.responses():
        resp.SerializeToString()
        _busy(message_s)
        counts[0] += 1
        await asyncio.sleep(0)  # a write yields to the loop


def measure(
    streams: int, steps: int, step_s: float, message_s: float, handover: str, switch_s: float, interval: int = 1
) -> dict:
    """One setting: `steps` steps of `step_s` device time publishing to `streams` streams, `interval`
    tokens a message after each stream's first."""
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    set_stream_interval(interval)
    io, aio, counts = ThreadedIO(), asyncio.new_event_loop(), [0]
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()

    async def start() -> list[asyncio.Task]:
        tasks = []
        for i in range(streams):
            req = Req(rid=f"r{i}", prompt_ids=[1] * 16, params=SamplingParams(max_new_tokens=steps + 1))
            stream = RequestStream(io, req, True, None, frozenset())
            if handover == "batched":
                io.subscribe(req.rid, stream.on_update)
            else:  # the former path: every update wakes the loop on its own
                io.subscribe(req.rid, lambda upd, s=stream: aio.call_soon_threadsafe(s.deliver, upd))
            tasks.append(asyncio.ensure_future(_consume(stream, message_s, counts)))
        return tasks

    try:
        tasks = asyncio.run_coroutine_threadsafe(start(), aio).result(timeout=30)
        publish, t0 = [], time.perf_counter()
        for step in range(steps):
            time.sleep(step_s)  # the device step: the scheduler thread waits with the GIL released
            t = time.perf_counter()
            last = step == steps - 1
            io.publish([RequestUpdate(f"r{i}", [step % 97], finished=last, prompt_tokens=16) for i in range(streams)])
            publish.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.gather(*tasks), 120), aio).result(timeout=130)
        drained = time.perf_counter() - t0
    finally:
        aio.call_soon_threadsafe(aio.stop)
        thread.join(timeout=10)
        aio.close()
        sys.setswitchinterval(old_switch)
        set_stream_interval(1)
    publish.sort()
    return {
        "handover": handover,
        "switch_interval_ms": switch_s * 1e3,
        "stream_interval": interval,
        "streams": streams,
        "message_us": message_s * 1e6,
        "device_step_ms": step_s * 1e3,
        "step_wall_ms": wall / steps * 1e3,
        "publish_mean_ms": statistics.fmean(publish) * 1e3,
        "publish_p90_ms": publish[int(0.9 * (len(publish) - 1))] * 1e3,
        "all_sent_after_s": drained,
        "messages_per_stream": counts[0] / streams,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stream_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="fewer steps and settings")
    p.add_argument("--step-ms", type=float, default=8.0, help="the device step (a decode step of an 8B model)")
    p.add_argument("--stream-intervals", default="1", help="comma-separated --stream-interval settings to run")
    p.add_argument("--handovers", default=",".join(HANDOVERS), help="comma-separated subset of " + ", ".join(HANDOVERS))
    p.add_argument("--switch-ms", default="5,1", help="comma-separated GIL switch intervals (ms)")
    args = p.parse_args(argv)
    intervals = [int(k) for k in args.stream_intervals.split(",") if k]
    handovers = [h for h in args.handovers.split(",") if h]
    switches = [float(ms) for ms in args.switch_ms.split(",") if ms]
    if not intervals or min(intervals) < 1 or not set(handovers) <= set(HANDOVERS) or not switches:
        p.error("need --stream-intervals >= 1, --handovers among " + ", ".join(HANDOVERS) + " and a --switch-ms")
    steps = 40 if args.quick else 200
    streams = (200,) if args.quick else (100, 200, 300)
    message_us = (30.0,) if args.quick else (30.0, 60.0)
    rows: list[dict[str, Any]] = []
    for n in streams:
        for cost in message_us:
            for handover, switch_ms, k in ((h, sw, k) for h in handovers for sw in switches for k in intervals):
                row = measure(n, steps, args.step_ms / 1e3, cost / 1e6, handover, switch_ms / 1e3, k)
                rows.append(row)
                print(
                    f"{handover:>10} switch {switch_ms:g} ms, interval {k}, {n} streams, {cost:g} us/message: step "
                    f"{row['step_wall_ms']:.2f} ms (device {args.step_ms:g}), publish {row['publish_mean_ms']:.2f} "
                    f"ms, {row['messages_per_stream']:.0f} messages/stream",
                    flush=True,
                )
    write_report(
        args.out,
        {"bench": "stream_overhead", "quick": args.quick, "cpus": _nproc(), "loadavg": _loadavg(), "rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
