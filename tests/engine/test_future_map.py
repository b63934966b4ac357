"""FutureMap: publish/stash/resolve contracts, ordering, the production guard against unpublished
reads (CPU and CUDA), the debug consume-once guard, batch relays, chained event."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import engine.future_map as future_map_module
from engine.device_event import CompletedEvent
from engine.future_map import BatchRelay, FutureMap, FutureMapError, RelayPayload

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

TOPK, HIDDEN = 4, 8


def _idx(device: str, rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _payload(device: str, rows: list[int], base: int) -> RelayPayload:
    """Distinct, row-derived values so a clobbered row is recognisable."""
    n = len(rows)
    r = torch.tensor(rows, dtype=torch.float32, device=device)
    return RelayPayload(
        bonus_tokens=_idx(device, [base + x for x in rows]),
        topk_p=(r[:, None] + base + torch.arange(TOPK, device=device)) / 1000.0,
        topk_index=_idx(device, [base * 10 + x for x in rows])[:, None].repeat(1, TOPK),
        hidden_states=torch.full((n, HIDDEN), float(base), device=device) + r[:, None],
    )


def _assert_payload(got: RelayPayload, want: RelayPayload) -> None:
    assert torch.equal(got.bonus_tokens, want.bonus_tokens)
    for name in ("topk_p", "topk_index", "hidden_states"):
        g, w = getattr(got, name), getattr(want, name)
        assert g is not None and w is not None
        assert g.dtype == w.dtype
        assert torch.equal(g, w), name


def _fm(device: str, **kw: bool) -> FutureMap:
    kw.setdefault("need_topk", True)
    kw.setdefault("need_hidden", True)
    return FutureMap(16, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_publish_then_resolve_seq_lens(device: str) -> None:
    fm = _fm(device)
    idx = _idx(device, [3, 5, 7])
    fm.publish(idx, _idx(device, [10, 20, 30]))
    out = fm.resolve_seq_lens(idx)
    assert out.device.type == torch.device(device).type
    assert out.tolist() == [10, 20, 30]
    # Any order, any subset.
    assert fm.resolve_seq_lens(_idx(device, [7, 3])).tolist() == [30, 10]


@pytest.mark.parametrize("device", DEVICES)
def test_stash_then_resolve_payload(device: str) -> None:
    fm = _fm(device)
    rows = [2, 9, 4]
    payload = _payload(device, rows, base=100)
    fm.publish(_idx(device, rows), _idx(device, [1, 2, 3]))
    fm.stash(_idx(device, rows), payload)
    _assert_payload(fm.resolve(_idx(device, rows)), payload)
    assert fm.topk_p_buf is not None and fm.topk_p_buf.shape == (16, TOPK)
    assert fm.hidden_states_buf is not None and fm.hidden_states_buf.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_padding_row_zero_is_harmless(device: str) -> None:
    fm = _fm(device, debug=True)
    rows = [1, 2]
    fm.publish(_idx(device, rows), _idx(device, [11, 12]))
    fm.stash(_idx(device, rows), _payload(device, rows, base=50))
    # A graph-padded batch: the tail entries point at row 0, possibly several times.
    padded = _idx(device, [1, 2, 0, 0])
    fm.publish(padded, _idx(device, [21, 22, 999, 998]))
    fm.stash(padded, _payload(device, [1, 2, 0, 0], base=70))
    assert fm.resolve_seq_lens(padded)[:2].tolist() == [21, 22]
    got = fm.resolve(padded)
    assert got.bonus_tokens[:2].tolist() == [71, 72]
    # Padding reads row 0 repeatedly without tripping the consume-once guard.
    fm.resolve_seq_lens(_idx(device, [0, 0]))
    fm.resolve(_idx(device, [0]))


@pytest.mark.parametrize("device", DEVICES)
def test_lazy_buffers_only_when_needed(device: str) -> None:
    fm = _fm(device, need_topk=False, need_hidden=False)
    assert fm.output_tokens_buf.shape == (16,) and fm.new_seq_lens_buf.shape == (16,)
    assert fm.topk_p_buf is None and fm.topk_index_buf is None and fm.hidden_states_buf is None
    rows = [3, 4]
    fm.stash(_idx(device, []), RelayPayload(_idx(device, [])))  # empty: no-op
    fm.stash(_idx(device, rows), _payload(device, rows, base=5))
    assert fm.topk_p_buf is None and fm.hidden_states_buf is None
    got = fm.resolve(_idx(device, rows))
    assert got.bonus_tokens.tolist() == [8, 9]
    assert got.topk_p is None and got.topk_index is None and got.hidden_states is None

    fm2 = _fm(device, need_topk=True, need_hidden=False)
    fm2.stash(_idx(device, []), RelayPayload(_idx(device, [])))
    assert fm2.topk_p_buf is None  # an empty stash allocates nothing
    fm2.stash(_idx(device, rows), _payload(device, rows, base=5))
    assert fm2.topk_p_buf is not None and fm2.topk_index_buf is not None
    assert fm2.topk_index_buf.dtype == torch.int64 and fm2.hidden_states_buf is None
    got = fm2.resolve(_idx(device, rows))
    assert got.topk_p is not None and got.hidden_states is None


@pytest.mark.parametrize("device", DEVICES)
def test_missing_required_extras_is_an_error(device: str) -> None:
    fm = _fm(device)
    with pytest.raises(FutureMapError):
        fm.stash(_idx(device, [1]), RelayPayload(_idx(device, [7])))
    with pytest.raises(FutureMapError):
        fm.resolve(_idx(device, [1]))  # nothing with top-k was ever stashed
    with pytest.raises(FutureMapError):
        fm.publish(_idx(device, [1, 2]), _idx(device, [3]))  # row count mismatch


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_batches_keep_their_rows(device: str) -> None:
    fm = _fm(device, debug=True)
    rows_n, rows_n1 = [1, 2, 3], [4, 5]
    pay_n, pay_n1 = _payload(device, rows_n, 100), _payload(device, rows_n1, 200)
    # Batch N publishes and stashes; batch N+1 (other rows) does too before N+1's consumers run.
    fm.publish(_idx(device, rows_n), _idx(device, [10, 11, 12]))
    fm.stash(_idx(device, rows_n), pay_n)
    fm.publish(_idx(device, rows_n1), _idx(device, [40, 41]))
    fm.stash(_idx(device, rows_n1), pay_n1)
    assert fm.resolve_seq_lens(_idx(device, rows_n)).tolist() == [10, 11, 12]
    assert fm.resolve_seq_lens(_idx(device, rows_n1)).tolist() == [40, 41]
    _assert_payload(fm.resolve(_idx(device, rows_n)), pay_n)
    _assert_payload(fm.resolve(_idx(device, rows_n1)), pay_n1)


@pytest.mark.parametrize("device", DEVICES)
def test_seeding_between_publish_and_stash(device: str) -> None:
    fm = _fm(device, debug=True)
    inflight, seeded = [1, 2], [6, 7, 8]
    pay_inflight, pay_seeded = _payload(device, inflight, 300), _payload(device, seeded, 400)
    fm.publish(_idx(device, inflight), _idx(device, [5, 6]))  # forward: after verify
    fm.batch(_idx(device, seeded)).seed(_idx(device, [17, 18, 19]), pay_seeded)  # PD prebuilt
    fm.stash(_idx(device, inflight), pay_inflight)  # forward: after it returns
    merged = _idx(device, inflight + seeded)  # the next decode batch merges both
    assert fm.resolve_seq_lens(merged).tolist() == [5, 6, 17, 18, 19]
    got = fm.resolve(merged)
    _assert_payload(
        RelayPayload(got.bonus_tokens[:2], got.topk_p[:2], got.topk_index[:2], got.hidden_states[:2]), pay_inflight
    )
    _assert_payload(
        RelayPayload(got.bonus_tokens[2:], got.topk_p[2:], got.topk_index[2:], got.hidden_states[2:]), pay_seeded
    )


@pytest.mark.parametrize("debug", [False, True])
def test_unpublished_read_raises_on_cpu(debug: bool) -> None:
    fm = _fm("cpu", debug=debug)  # the guard is on in production too, not only in debug
    with pytest.raises(FutureMapError, match="new_seq_lens"):
        fm.resolve_seq_lens(_idx("cpu", [3]))
    fm.publish(_idx("cpu", [3]), _idx("cpu", [9]))
    fm.stash(_idx("cpu", [4]), _payload("cpu", [4], 1))
    with pytest.raises(FutureMapError, match="output_tokens"):
        fm.resolve(_idx("cpu", [3]))  # row 3 published, never stashed


def test_released_rows_fail_their_next_read() -> None:
    fm = _fm("cpu")
    idx = _idx("cpu", [2, 5])
    fm.publish(idx, _idx("cpu", [7, 8]))
    fm.stash(idx, _payload("cpu", [2, 5], 10))
    fm.invalidate(_idx("cpu", [5]))  # slot 5 went back to the pool
    assert fm.resolve_seq_lens(_idx("cpu", [2])).tolist() == [7]
    with pytest.raises(FutureMapError, match=r"rows \[5\]"):
        fm.resolve_seq_lens(idx)
    with pytest.raises(FutureMapError, match="output_tokens"):
        fm.resolve(_idx("cpu", [5]))
    assert not fm.rows_free()
    fm.invalidate(_idx("cpu", [2]))
    assert fm.rows_free()


def test_batch_relay_publishes_stashes_and_selects() -> None:
    fm = _fm("cpu", need_topk=False, need_hidden=False)
    relay = fm.batch([3, 6, 9])
    assert isinstance(relay, BatchRelay) and len(relay) == 3
    relay.on_publish(_idx("cpu", [4, 5, 6]))
    relay.select([True, False, True]).stash(RelayPayload(_idx("cpu", [30, 90])))
    assert relay.resolve_seq_lens().tolist() == [4, 5, 6]
    assert fm.batch([9, 3]).resolve().bonus_tokens.tolist() == [90, 30]
    with pytest.raises(FutureMapError):
        fm.batch([6]).resolve()  # row 6 sampled nothing: never stashed
    assert relay.select([True] * 3) is relay


def test_debug_double_consume_raises_on_cpu() -> None:
    fm = _fm("cpu", debug=True)
    idx = _idx("cpu", [2, 5])
    fm.publish(idx, _idx("cpu", [1, 2]))
    fm.stash(idx, _payload("cpu", [2, 5], 10))
    fm.resolve_seq_lens(idx)
    fm.resolve(idx)
    assert fm.new_seq_lens_buf[idx].tolist() == [-1, -1]  # consumed rows re-poisoned
    with pytest.raises(FutureMapError):
        fm.resolve_seq_lens(idx)
    with pytest.raises(FutureMapError):
        fm.resolve(idx)
    # A fresh publish/stash makes the rows readable again.
    fm.publish(idx, _idx("cpu", [3, 4]))
    fm.stash(idx, _payload("cpu", [2, 5], 20))
    assert fm.resolve_seq_lens(idx).tolist() == [3, 4]
    assert fm.resolve(idx).bonus_tokens.tolist() == [22, 25]


def test_non_debug_allows_rereads() -> None:
    fm = _fm("cpu")
    idx = _idx("cpu", [2])
    fm.publish(idx, _idx("cpu", [7]))
    assert fm.resolve_seq_lens(idx).tolist() == [7]
    assert fm.resolve_seq_lens(idx).tolist() == [7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("debug", [False, True])
def test_async_assert_surfaces_on_cuda(debug: bool) -> None:
    # A failed device assert poisons the CUDA context, so it runs in its own process. The read
    # itself returns without a host sync; the failure surfaces at the next synchronize.
    code = textwrap.dedent(f"""
        import torch
        from engine.future_map import FutureMap
        fm = FutureMap(8, "cuda", need_topk=False, need_hidden=False, debug={debug})
        fm.resolve_seq_lens(torch.tensor([3], device="cuda"))
        print("RETURNED")
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            print("ASYNC-ASSERT", e)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RETURNED" in res.stdout, (res.stdout, res.stderr)
    assert "ASYNC-ASSERT" in res.stdout or "Assertion" in res.stderr, (res.stdout, res.stderr)


@pytest.mark.parametrize("device", DEVICES)
def test_chained_event_rerecorded(device: str) -> None:
    fm = _fm(device)
    assert fm.published_event is None
    fm.publish(_idx(device, []), _idx(device, []))  # empty: no event yet
    assert fm.published_event is None
    fm.publish(_idx(device, [1]), _idx(device, [4]))
    first = fm.published_event
    assert first is not None
    fm.publish(_idx(device, [2]), _idx(device, [5]))
    assert fm.published_event is first  # same object, recorded again
    first.wait()
    first.synchronize()
    assert first.query() is True
    if device == "cpu":
        assert isinstance(first, CompletedEvent)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chained_event_covers_other_stream_publish() -> None:
    fm = _fm("cuda")
    fm.publish(_idx("cuda", [1]), _idx("cuda", [0]))
    torch.cuda.synchronize()
    # Inputs made up front: a pageable H2D copy inside the slow stream would block the host.
    rows_a, lens_a, rows_b, lens_b = (_idx("cuda", [v]) for v in (1, 42, 2, 43))
    torch.cuda.synchronize()
    slow, seed = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(slow):  # the in-flight forward: its publish lands late
        torch.cuda._sleep(1_000_000_000)
        fm.publish(rows_a, lens_a)
    with torch.cuda.stream(seed):  # PD seeding from the schedule stream, meanwhile
        fm.publish(rows_b, lens_b)
    # Without chaining the seed record would fire while the forward still sleeps.
    assert fm.published_event is not None and fm.published_event.query() is False
    with torch.cuda.stream(torch.cuda.Stream()):
        out = fm.resolve_seq_lens(_idx("cuda", [1, 2]))
        assert out.tolist() == [42, 43]
    torch.cuda.synchronize()
    assert fm.published_event.query() is True


def test_module_never_names_backend_event_class() -> None:
    source = inspect.getsource(future_map_module)
    assert "torch.cuda.Event" not in source
    assert "cuda.Event" not in source
