"""`pdserve up` with its defaults on a GPU host: device auto, KV sized from GPU memory, real router.

Starts the deployment the README's `make up` starts (built-in pair, one prefill and one decode
node, no --device, no --max-total-tokens), times the start-up, sends a completion and a chat
completion through the OpenAI API, reads each node's KV sizing line and the GPUs' memory, then
stops everything. Not a speed measurement: it shows the defaults work on real GPUs.

Run on the GPU machine: `python -m bench.gpu.up_smoke OUT` (writes OUT/gpu_up_smoke.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import write_report
from pdserve.up import Deployment, UpConfig, served_model

START_TIMEOUT_S = 420.0


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def gpu_memory() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:  # a CPU host (dry run)
        return []
    return out.stdout.strip().splitlines()


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results")
    dep = Deployment(UpConfig(None, port=18000, start_timeout_s=START_TIMEOUT_S))
    t0 = time.monotonic()
    report: dict[str, Any] = {"command": "python -m bench.gpu.up_smoke OUT"}
    try:
        url = dep.start(lambda msg: print(f"[{time.monotonic() - t0:6.1f} s] {msg}", flush=True))
        report["start_s"] = time.monotonic() - t0
        model = served_model(url)
        comp = post(
            f"{url}/v1/completions", {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}
        )
        chat = post(
            f"{url}/v1/chat/completions",
            {
                "model": model,
                "max_tokens": 48,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Sort a list in Python."}],
            },
        )
        report.update(
            model=model,
            completion=comp["choices"][0]["text"],
            completion_usage=comp["usage"],
            chat=chat["choices"][0]["message"]["content"],
            gpus=gpu_memory(),
        )
    finally:
        report["kv_lines"] = {
            c.name: [ln for ln in c.lines if "KV cache" in ln or "device" in ln.lower()][:4] for c in dep.children
        }
        report["node_devices"] = [(c.name, c.proc.args) for c in dep.children]
        dep.stop()
    print(json.dumps(report, indent=2, default=str))
    write_report(out / "gpu_up_smoke.json", report)
    ok = bool(report.get("completion", "").strip()) and bool(report.get("chat", "").strip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
