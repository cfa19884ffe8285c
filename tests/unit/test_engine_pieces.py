"""The engine's pure pieces, without communication: fusion planning, message splitting,
in-place spans, the response cache, the timeline file."""
from __future__ import annotations

import json

import torch

from psrt.comm.base import ElementwiseOp
from psrt.engine.fusion import contiguous_span, messages, pack, plan, unpack
from psrt.engine.negotiation import Response, ResponseCache
from psrt.engine.timeline import Timeline
from psrt.engine.work import Announcement, BufferSpec, Reduction

MiB = 1 << 20


def allreduce(name: str, numel: int, dtype=torch.float32, op=ElementwiseOp.SUM, scale=1.0,
              set_id=0) -> Response:
    reduction = Reduction(set_id, "cpu", op, (BufferSpec(numel, dtype, scale),))
    return Response(Announcement((set_id, name), (0, 1), (("collective", "allreduce"),),
                                 reduction, True))


def other(name: str) -> Response:
    return Response(Announcement((0, name), (0, 1), (("collective", "broadcast"),), None, True))


def names(batches) -> list[list[str]]:
    return [[r.announcement.name for r in b.responses] for b in batches]


def test_plan_fuses_compatible_allreduces_up_to_the_threshold_in_response_order():
    responses = [allreduce("a", 100), allreduce("b", 100), other("c"), allreduce("d", 100),
                 allreduce("e", 100, op=ElementwiseOp.MAX)]
    assert names(plan(responses, threshold=1200)) == [["a", "b", "d"], ["c"], ["e"]]
    assert names(plan(responses, threshold=800)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert names(plan(responses, threshold=0)) == [["a"], ["b"], ["c"], ["d"], ["e"]]


def test_plan_keeps_process_sets_apart_and_errors_alone():
    responses = [allreduce("a", 10), allreduce("b", 10, set_id=1), allreduce("c", 10)]
    failed = Response(allreduce("e", 10).announcement, "mismatch")
    assert names(plan(responses + [failed], threshold=1 << 30)) == [["a", "c"], ["b"], ["e"]]
    assert not plan([failed], 1 << 30)[0].fused


def pieces(*specs) -> list[BufferSpec]:
    return [BufferSpec(nbytes // dtype.itemsize, dtype, scale) for nbytes, dtype, scale in specs]


def test_messages_send_large_pieces_alone_and_pack_runs_of_one_dtype_and_scale():
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    batch = pieces((40, f32, .5), (80, f32, .5), (2 * MiB, f32, .5), (40, f32, .5), (MiB, f32, .5),
                   (40, f32, .5), (40, f32, .5))
    assert messages(batch) == [[0, 1], [2], [3], [4], [5, 6]]
    mixed = pieces((40, f32, .5), (40, f64, .5), (40, f64, .5), (40, i32, 1.0), (40, f32, 1.0))
    assert messages(mixed) == [[0], [1, 2], [3], [4]]
    assert messages([]) == []
    assert messages(pieces(*[(MiB - 4, f32, 1.0)] * 3)) == [[0, 1, 2]]


def test_contiguous_span_is_a_view_only_for_back_to_back_pieces_of_one_storage():
    flat = torch.arange(10.0)
    a, b, c = flat.split([3, 3, 4])
    span = contiguous_span([a, b, c])
    assert span is not None and span.data_ptr() == flat.data_ptr() and span.numel() == 10
    assert contiguous_span([a, c]) is None  # a gap
    assert contiguous_span([b, a]) is None  # out of order
    assert contiguous_span([torch.zeros(3), torch.zeros(3)]) is None  # separate storages
    grid = flat.view(2, 5)
    assert contiguous_span([grid[:, 0], grid[:, 1]]) is None  # not contiguous


def test_pack_and_unpack_round_trip():
    pieces = [torch.arange(3.0), torch.full((2, 2), 7.0), torch.tensor([9.0])]
    staging = torch.empty(8)
    pack(pieces, staging)
    assert staging.tolist() == [0, 1, 2, 7, 7, 7, 7, 9]
    out = [torch.empty_like(p) for p in pieces]
    unpack(staging * 2, out)
    assert all(torch.equal(o, p * 2) for o, p in zip(out, pieces))


def test_joined_zeros_match_the_pieces():
    reduction = Reduction(0, "cpu", ElementwiseOp.SUM, (BufferSpec(3, torch.int32, 1.0),
                                                         BufferSpec(0, torch.float32, 1.0),
                                                         BufferSpec(2, torch.float64, 0.5)))
    zeros = reduction.zeros()
    assert [(z.shape, z.dtype) for z in zeros] == [((3,), torch.int32), ((0,), torch.float32),
                                                   ((2,), torch.float64)]
    assert not any(z.any() for z in zeros) and reduction.nbytes == 12 + 16


def test_response_cache_matches_key_and_descriptor_and_stops_growing_when_full():
    cache = ResponseCache(capacity=2)
    a, b, c = (allreduce(n, 4).announcement for n in "abc")
    cache.add(a)
    cache.add(b)
    cache.add(c)  # full: not cached
    assert (cache.lookup(a), cache.lookup(b), cache.lookup(c)) == (0, 1, None)
    reshaped = allreduce("a", 5).announcement
    assert cache.lookup(reshaped) is None  # same name, different work


def test_timeline_is_valid_chrome_trace_json(tmp_path):
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), rank=0, mark_cycles=True)
    timeline.cycle(1.0)
    timeline.phase("grad.w", "NEGOTIATE", 1.0, 1.5)
    timeline.phase("grad.w", "ALLREDUCE", 1.5, 2.0)
    timeline.phase("grad.b", "QUEUE", 1.2, 1.3)
    timeline.close()
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["NEGOTIATE", "ALLREDUCE", "QUEUE"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in complete)
    rows = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(rows) == {"grad.w", "grad.b"} and complete[0]["tid"] == rows["grad.w"]
    assert any(e["name"] == "CYCLE_START" for e in events)


def test_a_device_work_waits_for_its_producer_and_its_consumer_waits_for_it():
    """No GPU needed (the fake device of tests/fake_device.py): the producer's stream records
    the ready event when the work is submitted, the communication stream waits for it before
    the collective and records the done event after, and the consumer's stream waits for that
    when the work's result is taken; the host waits for none of it."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fake_device
    from psrt.comm import streams
    from psrt.engine.engine import Engine
    from psrt.engine.execution import _on_communication_stream
    from psrt.engine.work import Work

    with fake_device.install() as cuda:
        queued = []
        engine = SimpleNamespace(_submissions=SimpleNamespace(put=lambda work, wake: queued.append(work)))
        work = Work(allreduce("g", 4).announcement, device=torch.device("cpu"), buffers=[torch.zeros(4)])
        produced = cuda.compute.tick()  # the producer's kernel
        Engine.submit(engine, work)
        assert queued == [work] and work.streams.ready.stream is cuda.compute
        assert work.streams.ready.clock == produced
        with _on_communication_stream([work], "allreduce"):
            stream = cuda.current(work.device)
            assert stream is streams.device_streams(work.device).reduce and stream.after(cuda.compute, produced)
            reduced = stream.tick()  # the collective
        work.complete(None)
        assert not cuda.compute.after(stream, reduced)
        work.result()
        assert cuda.compute.after(stream, reduced) and not cuda.host_waits
