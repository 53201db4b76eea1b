"""SessionOutbox: a bounded queue that never blocks its writer; a slow reader loses chunk events (the oldest
first) and is told so by one coalesced stall event, placed where the first lost event was."""

from __future__ import annotations

import pytest

from fewstep.engine.live import OutboxFullError, SessionOutbox


def drain(box: SessionOutbox) -> list:
    out = []
    while (item := box.pop()) is not None:
        out.append(item)
    return out


def chunk(i: int) -> dict:
    return {"chunk": i}


def test_events_come_out_in_order_and_pop_never_blocks():
    box = SessionOutbox(4)
    assert box.pop() is None
    box.put("fewstep.session", {"state": "opened"})
    box.put("fewstep.chunk", chunk(0), droppable=True)
    assert len(box) == 2
    assert drain(box) == [("fewstep.session", {"state": "opened"}), ("fewstep.chunk", chunk(0))]


def test_a_full_outbox_drops_the_oldest_chunk_event_and_announces_one_stall_in_its_place():
    box = SessionOutbox(3, tags={"session": "x"})
    box.put("fewstep.session", {"state": "opened"})
    for i in range(5):  # room for 2 chunks beside the session event: 0, 1, 2 dropped (oldest first)
        box.put("fewstep.chunk", chunk(i), droppable=True)
    assert box.dropped == 3
    assert drain(box) == [
        ("fewstep.session", {"state": "opened"}),
        ("fewstep.stall", {"session": "x", "dropped": 3, "chunks": [0, 1, 2]}),
        ("fewstep.chunk", chunk(3)),
        ("fewstep.chunk", chunk(4)),
    ]


def test_a_stall_counts_only_the_drops_since_the_last_stall_event():
    box = SessionOutbox(2)
    for i in range(3):
        box.put("fewstep.chunk", chunk(i), droppable=True)
    assert drain(box) == [
        ("fewstep.stall", {"dropped": 1, "chunks": [0]}),
        ("fewstep.chunk", chunk(1)),
        ("fewstep.chunk", chunk(2)),
    ]
    box.put("fewstep.chunk", chunk(3), droppable=True)
    box.put("fewstep.metrics", {"chunks": 4})
    box.put("fewstep.chunk", chunk(4), droppable=True)  # full: chunk 3 dropped, the metrics event kept
    assert drain(box) == [
        ("fewstep.stall", {"dropped": 1, "chunks": [3]}),
        ("fewstep.metrics", {"chunks": 4}),
        ("fewstep.chunk", chunk(4)),
    ]
    assert box.dropped == 2


def test_the_stall_is_handed_out_where_the_first_lost_event_was_even_while_the_reader_catches_up():
    box = SessionOutbox(3)
    box.put("fewstep.control_applied", {"control": 1})
    box.put("fewstep.session", {"state": "resumed"})
    box.put("fewstep.chunk", chunk(0), droppable=True)
    box.put("fewstep.chunk", chunk(1), droppable=True)  # drops chunk 0 (position 2)
    assert box.pop() == ("fewstep.control_applied", {"control": 1})
    box.put("fewstep.chunk", chunk(2), droppable=True)  # room again: nothing dropped
    assert drain(box) == [
        ("fewstep.session", {"state": "resumed"}),
        ("fewstep.stall", {"dropped": 1, "chunks": [0]}),
        ("fewstep.chunk", chunk(1)),
        ("fewstep.chunk", chunk(2)),
    ]


def test_full_of_events_that_may_not_be_dropped_drops_a_new_chunk_and_refuses_anything_else():
    box = SessionOutbox(2)
    box.put("fewstep.session", {"state": "opened"})
    box.put("fewstep.control_applied", {"control": 1})
    box.put("fewstep.chunk", chunk(0), droppable=True)  # nothing queued may go: the new chunk is dropped
    with pytest.raises(OutboxFullError):
        box.put("fewstep.control_applied", {"control": 2})
    assert box.dropped == 1
    assert drain(box) == [
        ("fewstep.session", {"state": "opened"}),
        ("fewstep.control_applied", {"control": 1}),
        ("fewstep.stall", {"dropped": 1, "chunks": [0]}),
    ]


def test_a_dropped_deadline_miss_is_not_counted_as_a_lost_chunk():
    box = SessionOutbox(2)
    box.put("fewstep.deadline_missed", {"chunk": 0}, droppable=True)
    box.put("fewstep.chunk", chunk(1), droppable=True)
    box.put("fewstep.chunk", chunk(2), droppable=True)  # drops the deadline miss: no stall
    assert box.dropped == 0
    assert drain(box) == [("fewstep.chunk", chunk(1)), ("fewstep.chunk", chunk(2))]


def test_forced_events_go_past_the_bound():
    box = SessionOutbox(1)
    box.put("fewstep.metrics", {"chunks": 1})
    box.put("fewstep.session", {"state": "closed"}, force=True)
    assert [e for e, _ in drain(box)] == ["fewstep.metrics", "fewstep.session"]


def test_the_listener_is_called_after_each_put_and_a_closed_outbox_takes_nothing_more():
    box = SessionOutbox(4)
    calls = []
    box.set_listener(lambda: calls.append(len(box)))
    box.put("fewstep.chunk", chunk(0), droppable=True)
    box.put("fewstep.chunk", chunk(1), droppable=True)
    assert calls == [1, 2]
    box.close()
    box.put("fewstep.chunk", chunk(2), droppable=True)
    assert box.closed and calls == [1, 2]
    assert [e for e, _ in drain(box)] == ["fewstep.chunk", "fewstep.chunk"]
