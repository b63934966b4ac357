"""A PD handoff done by hand in one process: what prefill_node + NIXL + decode_node do."""

from __future__ import annotations

import dataclasses

import torch

from engine.core import HandoffState, Req, SamplingParams
from engine.engine import Engine


def hand_off(prefill: Engine, decode: Engine, prompt: list[int], rid: str, params: SamplingParams) -> Req:
    """Prefill `prompt` on one engine (holding its KV like a prefill node), copy target + draft KV
    pages and the draft state to the other, and return the decode side's PREBUILT request."""
    src = prefill.make_request(prompt, dataclasses.replace(params, max_new_tokens=1), rid)
    src.hold_kv = True  # KV and draft state stay for the transfer
    prefill.io.submit(src)
    while not src.output_ids:
        prefill.step()
    req = Req(rid, list(prompt), params, output_ids=[src.output_ids[0]], seq_len=src.seq_len)
    decode.kv.assign_slot(req)
    decode.kv.reserve(req, req.seq_len)
    pages_src = torch.tensor(prefill.kv.page_list(src)[:prefill.kv.pages_for(src.seq_len)])
    pages_dst = torch.tensor(decode.kv.page_list(req))
    for a, b in ((prefill.parts.runner.pool, decode.parts.runner.pool),
                 (prefill.executor.draft.pool, decode.executor.draft.pool)):  # target and draft KV
        b.buffer[:, :, pages_dst] = a.buffer[:, :, pages_src]
    st = src.spec_state
    req.handoff = HandoffState(src.output_ids[0], st.topk_p.clone(), st.topk_index.clone(), st.hidden.clone())
    prefill.scheduler.release_kv(src)  # the transfer ended: held pages go back
    return req
