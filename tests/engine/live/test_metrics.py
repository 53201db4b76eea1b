"""RealtimeMetrics against numbers computed by hand, with injected times."""

from __future__ import annotations

from fewstep.engine.live import RealtimeMetrics
from fewstep.engine.live.metrics import RECENT_INTERVALS, percentile


def test_metrics_of_a_session_by_hand():
    m = RealtimeMetrics(fps=16, opened_at=100.0)
    # chunk 0 (9 frames = 0.5625 s) done at 101.0; chunk 1 (12 frames = 0.75 s) at 101.5: the viewer plays chunk 0
    # 101.0..101.5625, so chunk 1 came in time; chunk 2 at 103.0: the buffer ran out at 102.3125 -> a stall of
    # 0.6875 s; chunk 3 at 103.2 (buffer until 103.75): in time
    m.record_chunk(0.5625, latency=1.0, deadline_met=False, batch=1, done_at=101.0)
    m.record_chunk(0.75, latency=0.5, deadline_met=True, batch=2, done_at=101.5)
    m.record_chunk(0.75, latency=1.5, deadline_met=False, batch=2, done_at=103.0)
    m.record_chunk(0.75, latency=0.2, deadline_met=True, batch=2, done_at=103.2)
    got = m.as_dict(now=104.0)
    # intervals 0.5, 1.5, 0.2 -> sorted 0.2, 0.5, 1.5: p50 0.5; p99 at rank 1.98: 0.5 + 0.98 * 1.0
    assert got == {
        "time_to_first_chunk_s": 1.0,
        "inter_chunk_p50_s": 0.5,
        "inter_chunk_p99_s": 1.48,
        "realtime_factor": round(2.8125 / 4.0, 6),
        "deadline_attainment": 0.5,
        "viewer_stalls": 1,
        "viewer_stall_seconds": 0.6875,
        "batch_sizes": {"1": 1, "2": 3},
        "chunks": 4,
        "video_seconds": 2.8125,
        "seconds": 4.0,
    }


def test_a_closed_session_counts_wall_seconds_up_to_its_close():
    m = RealtimeMetrics(fps=16, opened_at=0.0)
    m.record_chunk(0.75, latency=0.1, deadline_met=True, batch=1, done_at=0.5)
    m.close(at=1.5)
    assert m.as_dict()["realtime_factor"] == 0.5
    assert m.as_dict()["seconds"] == 1.5


def test_a_session_without_chunks_has_no_rates_yet():
    got = RealtimeMetrics(opened_at=0.0).as_dict(now=2.0)
    assert got["time_to_first_chunk_s"] is None and got["inter_chunk_p50_s"] is None
    assert got["deadline_attainment"] is None and got["realtime_factor"] == 0.0
    assert (got["chunks"], got["viewer_stalls"], got["batch_sizes"]) == (0, 0, {})


def test_memory_stays_bounded_over_a_long_run():
    m = RealtimeMetrics(opened_at=0.0)
    for i in range(RECENT_INTERVALS * 4):
        m.record_chunk(0.75, latency=0.1, deadline_met=True, batch=1 + i % 3, done_at=float(i))
    assert len(m.intervals) == RECENT_INTERVALS
    assert len(m.batch_sizes) == 3 and m.chunks == RECENT_INTERVALS * 4


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
