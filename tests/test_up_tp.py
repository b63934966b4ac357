"""`pdserve up --tp-size N`: node k's ranks on GPUs k*N .. k*N+N-1 (PD roles as colocated ones), too
few GPUs refused, and a colocated TP 2 deployment on the CPU that serves; flags for decode nodes
alone reach them alone."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

import pdserve.up as up
from pdserve.cli import app
from fixtures.procs import start_up
from pdserve.tp import TpSetupError


def _plans(monkeypatch: pytest.MonkeyPatch, gpus: int, **cfg: object) -> list[tuple[str, list[str], str]]:
    monkeypatch.setattr(up, "_cuda_count", lambda: gpus)
    dep = up.Deployment(up.UpConfig(None, device="cuda", **cfg))  # type: ignore[arg-type]
    common = ["--tp-size", str(dep.cfg.tp_size)]
    return dep._colocated_plans(common) if dep.cfg.colocated else dep._pd_plans(common)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_each_node_owns_consecutive_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = _plans(monkeypatch, 4, colocated=2, tp_size=2)
    assert [dev for _, _, dev in plans] == ["cuda:0", "cuda:2"]
    assert [_flag(args, "--device") for _, args, _ in plans] == ["cuda:0", "cuda:0"]  # isolated: its first GPU
    assert [up._visible(dev, 2) for _, _, dev in plans] == ["0,1", "2,3"]
    shared = _plans(monkeypatch, 4, colocated=2, tp_size=2, isolate_gpus=False)
    assert [_flag(args, "--device") for _, args, _ in shared] == ["cuda:0", "cuda:2"]
    assert up._waves(plans, sizes_kv_itself=False) == [plans]  # no GPU shared: all load at once
    pd = _plans(monkeypatch, 4, prefill=1, decode=1, tp_size=2)  # PD nodes pair at any TP size
    assert [(name, dev) for name, _, dev in pd] == [("prefill-0", "cuda:0"), ("decode-0", "cuda:2")]
    assert all(_flag(args, "--tp-size") == "2" for _, args, _ in pd)


def test_too_few_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TpSetupError, match="needs 6 GPUs .* this machine has 4"):
        _plans(monkeypatch, 4, colocated=3, tp_size=2)
    monkeypatch.setattr(up, "_cuda_count", lambda: 2)
    res = CliRunner().invoke(app, ["up", "--colocated", "2", "--tp-size", "2", "--device", "cuda"])
    assert res.exit_code == 2 and "needs 4 GPUs" in res.output, res.output


def test_bad_sizes_fail_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "Deployment", None)  # reaching it would be a bug
    res = CliRunner().invoke(app, ["up", "--colocated", "1", "--tp-size", "0"])
    assert res.exit_code == 2 and "--tp-size must be >= 1" in res.output, res.output


@pytest.mark.slow
def test_colocated_tp2_deployment_serves_and_stops(tmp_path: Path) -> None:
    """Ctrl-C stops the node, which stops its rank: no rank sees its group break on the way out."""
    stderr = open(tmp_path / "up.stderr", "w")  # noqa: SIM115 - closed in the finally below
    proc = start_up(["--colocated", "1", "--tp-size", "2", "--device", "cpu", "--port", "0", "--verbose"], stderr)
    procs: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        line = ""
        while not line.startswith("pdserve is up: "):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, f"up never came up (exit {proc.poll()})"
        url = line.split()[3]
        procs = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in procs]
        assert any("serve" in c and "--tp-size 2" in c for c in cmdlines), cmdlines
        assert any("spawn_main" in c for c in cmdlines), cmdlines  # the node's second rank
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] >= 1
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, alive
        stderr.flush()
        logs = (tmp_path / "up.stderr").read_text()
        assert "[colocated-0]" in logs and not [ln for ln in logs.splitlines() if "broke" in ln or "Traceback" in ln]
    finally:
        stderr.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in procs:
            if p.is_running():
                p.kill()


def test_each_role_alone_gets_its_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """`up --local-prefill-tpot-ms 12` reaches every decode node and no other, `--local-decode-tpot-ms
    9` every prefill node and no other; a negative one is a one-line error before anything starts."""
    from pdserve.node_cli import _guard_args

    guard = _guard_args("--local-prefill-tpot-ms", 12.0)
    assert guard == ("--local-prefill-tpot-ms", "12") and _guard_args("--local-prefill-tpot-ms", None) == ()
    whole = _guard_args("--local-decode-tpot-ms", 9.0)
    plans = _plans(monkeypatch, 3, prefill=1, decode=2, decode_args=guard, prefill_args=whole)
    assert [_flag(args, "--local-prefill-tpot-ms") if "decode" in name else "--local-prefill-tpot-ms" in args
            for name, args, _ in plans] == [False, "12", "12"]  # fmt: skip
    assert [_flag(args, "--local-decode-tpot-ms") if "prefill" in name else "--local-decode-tpot-ms" in args
            for name, args, _ in plans] == ["9", False, False]  # fmt: skip
    for flag in ("--local-prefill-tpot-ms", "--local-decode-tpot-ms"):
        res = CliRunner().invoke(app, ["up", flag, "-1"])
        assert res.exit_code == 2 and f"{flag} must be >= 0" in res.output


def test_pooling_gives_prefill_nodes_the_decode_guard_unless_told() -> None:
    """`up --pd-pooling auto` starts prefill nodes that serve whole requests, at the decode nodes'
    guard unless --local-decode-tpot-ms says otherwise; pooling without the auto path policy is
    refused before anything starts."""
    from common.config import UpOptions
    from common.defaults import DEFAULT_LOCAL_PREFILL_TPOT_MS
    from pdserve.node_cli import _whole_guard_ms

    def guard(**kw: object) -> float | None:
        return _whole_guard_ms(UpOptions(**{"pd_prefill_policy": "auto", **kw}))  # type: ignore[arg-type]

    assert guard() is None and guard(local_decode_tpot_ms=9.0) == 9.0  # not pooled: as given
    assert guard(pd_pooling="auto") == DEFAULT_LOCAL_PREFILL_TPOT_MS
    assert guard(pd_pooling="auto", local_prefill_tpot_ms=12.0) == 12.0
    assert guard(pd_pooling="always", local_decode_tpot_ms=9.0, local_prefill_tpot_ms=12.0) == 9.0
    res = CliRunner().invoke(app, ["up", "--pd-pooling", "auto"])
    assert res.exit_code == 2 and "needs --pd-prefill-policy auto" in res.output


def test_up_passes_the_mixed_remote_target_to_its_router() -> None:
    """`up --pd-mixed-remote-ttft-target-ms 125` reaches the router as given (nothing when not
    given: the router's default); a negative one is a one-line error before anything starts."""
    from common.config import UpOptions
    from pdserve.node_cli import _router_args
    from tests.deploy.chartkit import cli_params

    assert _router_args(UpOptions()) == ()
    given = _router_args(UpOptions(pd_mixed_remote_ttft_target_ms=125.0))
    assert given == ("--pd-mixed-remote-ttft-target-ms", "125")
    assert cli_params(["router", *given])["pd_mixed_remote_ttft_target_ms"] == 125.0  # the router takes it
    res = CliRunner().invoke(app, ["up", "--pd-mixed-remote-ttft-target-ms", "-1"])
    assert res.exit_code == 2 and "--pd-mixed-remote-ttft-target-ms must be >= 0" in res.output
