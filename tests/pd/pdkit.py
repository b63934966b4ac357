"""Helpers for PD tests: node trios on loopback, paired Generate calls, load polling."""

from __future__ import annotations

import socket
import threading
import time

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pbg

from tests.procs import Node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub(port: int) -> pbg.SglangSchedulerStub:
    return pbg.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def request(rid: str, ids: list[int], room: int, bootstrap_port: int, *, max_new: int = 16,
            temperature: float = 0.0, stream: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
        sampling_params=pb.SamplingParams(temperature=temperature, max_new_tokens=max_new),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1",
                                                    bootstrap_port=bootstrap_port, bootstrap_room=room))


def pd_generate(prefill: pbg.SglangSchedulerStub, decode: pbg.SglangSchedulerStub,
                req: pb.GenerateRequest, timeout: float = 60.0) -> tuple[list, object]:
    """Both legs at once, as a router does; returns (decode responses, prefill result or error)."""
    box: dict[str, object] = {}

    def run_prefill() -> None:
        try:
            box["p"] = list(prefill.Generate(req, timeout=timeout))
        except grpc.RpcError as e:
            box["p"] = e

    t = threading.Thread(target=run_prefill)
    t.start()
    try:
        return list(decode.Generate(req, timeout=timeout)), box
    finally:
        t.join(timeout)


def used_tokens(s: pbg.SglangSchedulerStub) -> int:
    return s.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].num_used_tokens


def wait_idle(s: pbg.SglangSchedulerStub, timeout: float = 20.0) -> pb.SchedulerLoad:
    """Poll until the node holds no KV and has nothing queued or in transfer (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        load = s.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
        d = load.disaggregation
        busy = (load.num_used_tokens or load.num_running_reqs or load.num_waiting_reqs
                or d.prefill_prealloc_queue_reqs or d.prefill_inflight_queue_reqs
                or d.decode_prealloc_queue_reqs or d.decode_transfer_queue_reqs)
        if not busy:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"node still busy after {timeout} s: {load}")
        time.sleep(0.05)


def start_pair(model: str, *extra: str, prefill_extra: tuple[str, ...] = (),
               decode_extra: tuple[str, ...] = ()) -> tuple[Node, Node]:
    common = ["--model", model, "--port", "0", "--page-size", "4", *extra]
    p = Node(["prefill", *common, "--bootstrap-port", "0", *prefill_extra])
    d = Node(["decode", *common, *decode_extra])
    try:
        p.wait_ready(120)
        d.wait_ready(120)
    except Exception:
        p.kill()
        d.kill()
        raise
    return p, d
