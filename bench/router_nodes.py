"""Instant fake prefill + decode nodes for `bench.router_overhead`, in a process of their own.

Run: `python -m bench.router_nodes --tokenizer DIR [--tokens-per-chunk K] [--token-interval-ms M]`.
Serves one prefill and one decode `SglangScheduler` on 127.0.0.1, prints `READY prefill=HOST:PORT
decode=HOST:PORT` and runs until SIGTERM/SIGINT. Prefill completes at once with one token; decode
streams `max_new_tokens` tokens (ids of English text, so detokenization does real work) in chunks
of K (or of the request's own stream_interval, where larger, as a node does), M ms a token apart
(0: no delay; a decode step's pace makes many streams run at once, as in serving), then
GenerateComplete. GetModelInfo names DIR as the tokenizer, as a real node would.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pbg

from common.tokenizer import Tokenizer

TEXT = (
    " The decode phase generates one token at a time, reusing the key and value cache of the"
    " tokens before; serving systems batch many requests together so the accelerator stays busy."
)
MODES = {"prefill": "prefill", "decode": "decode"}
PERF = {"prefill_tokens_per_s": 40_000.0, "decode_step_s": {"1": 0.006, "64": 0.010}, "decode_tokens_per_step": 1.0}


class InstantNode(pbg.SglangSchedulerServicer):
    def __init__(
        self, role: str, tokenizer_dir: str, text_ids: list[int], per_chunk: int, token_interval_s: float = 0.0
    ) -> None:
        self.role, self.tokenizer_dir, self.ids, self.per_chunk = role, tokenizer_dir, text_ids, per_chunk
        self.token_interval_s = token_interval_s

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid, n_prompt = request.request_id, len(request.tokenized.input_ids)
        n = request.sampling_params.max_new_tokens or 16
        out = [self.ids[i % len(self.ids)] for i in range(n)]
        if self.role == "prefill":
            yield pb.GenerateResponse(
                request_id=rid,
                complete=pb.GenerateComplete(
                    output_ids=out[:1], finish_reason="length", prompt_tokens=n_prompt, completion_tokens=1
                ),
            )
            return
        per = max(self.per_chunk, request.sampling_params.stream_interval)
        for i in range(0, n, per):
            part = out[i : i + per]
            if self.token_interval_s and i:
                await asyncio.sleep(self.token_interval_s * len(part))
            yield pb.GenerateResponse(
                request_id=rid,
                chunk=pb.GenerateStreamChunk(token_ids=part, prompt_tokens=n_prompt, completion_tokens=i + len(part)),
            )
        yield pb.GenerateResponse(
            request_id=rid,
            complete=pb.GenerateComplete(
                output_ids=out, finish_reason="length", prompt_tokens=n_prompt, completion_tokens=n
            ),
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(success=True)

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            served_model_name="bench-model",
            model_path=self.tokenizer_dir,
            tokenizer_path=self.tokenizer_dir,
            max_context_length=4096,
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        args = struct_pb2.Struct()
        # measured rates, as a node reports them once it has run prompts and steps: without them
        # the router re-reads an unmeasured node after every request it routes there
        args.update({"disaggregation_mode": MODES[self.role], "perf": PERF})
        return pb.GetServerInfoResponse(server_args=args, server_type="grpc")

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        return pb.GetLoadsResponse(loads=[pb.SchedulerLoad()])


async def serve(tokenizer_dir: str, per_chunk: int, token_interval_s: float = 0.0) -> None:
    ids = Tokenizer.from_dir(tokenizer_dir).encode(TEXT, add_special_tokens=False)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    servers, addrs = [], []
    for role in ("prefill", "decode"):
        server = grpc.aio.server()
        node = InstantNode(role, tokenizer_dir, ids, per_chunk, token_interval_s)
        pbg.add_SglangSchedulerServicer_to_server(node, server)
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    print(f"READY prefill={addrs[0]} decode={addrs[1]}", flush=True)
    await stop.wait()
    await asyncio.gather(*(s.stop(grace=None) for s in servers))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.router_nodes", description=__doc__)
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json)")
    ap.add_argument("--tokens-per-chunk", type=int, default=4, help="decode tokens per stream message")
    ap.add_argument("--token-interval-ms", type=float, default=0.0, help="decode's pace: ms a token")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.tokenizer, max(1, args.tokens_per_chunk), max(0.0, args.token_interval_ms) / 1e3))


if __name__ == "__main__":
    main()
