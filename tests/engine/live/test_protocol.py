"""The protocol's body checks: one clear line naming the field, with the HTTP status its route answers."""

from __future__ import annotations

import base64

import pytest

from fewstep.engine.live import PROTOCOL, LiveError
from fewstep.engine.live.protocol import (
    MAX_START_IMAGE_BYTES,
    check_control,
    check_frames,
    check_open,
    decode_image_field,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 8


def refused(call, *args):
    with pytest.raises(LiveError) as err:
        call(*args)
    return err.value.status, err.value.text


def test_the_routes_and_bounds():
    assert PROTOCOL.sessions_route == "/fewstep/live/sessions"
    assert PROTOCOL.control_route.format(id="abc") == "/fewstep/live/sessions/abc/control"
    assert PROTOCOL.clip_route.format(id="abc", n=3) == "/fewstep/live/sessions/abc/chunks/3.webp"
    assert PROTOCOL.secret_header == "X-FewStep-Secret"
    assert PROTOCOL.max_body_bytes == 64 * 1024 and PROTOCOL.max_frames_body_bytes == 16 * 1024 * 1024
    assert PROTOCOL.max_open_body_bytes >= 64 * 1024 + len(base64.b64encode(b"\0" * MAX_START_IMAGE_BYTES))


def test_an_open_body_with_defaults():
    got = check_open({"client_id": "abc_1-2", "prompt": "a fox"})
    assert (got.client_id, got.prompt, got.seed, got.chunks, got.start_image, got.strength, got.jpeg,
            got.jpeg_quality) == ("abc_1-2", "a fox", 0, None, None, None, False, 80)  # fmt: skip


def test_open_bodies_refused():
    cases = [
        ([], 400, "body: expected a JSON object, got list"),
        ({"prompt": "x"}, 400, "client_id: expected the websocket clientId events go to: 1..128 characters of A-Z "
         "a-z 0-9 _ -, got None"),
        ({"client_id": "c", "prompt": "x" * 2001}, 400, "prompt: expected text of 1..2000 characters, got 2001"),
        ({"client_id": "c", "prompt": 3}, 400, "prompt: expected text of 1..2000 characters, got int"),
        ({"client_id": "c", "prompt": "x", "chunks": 0}, 400, "chunks: expected an integer >= 1, got 0"),
        ({"client_id": "c", "prompt": "x", "seed": True}, 400, "seed: expected an integer 0..9223372036854775807, "
         "got True"),
        ({"client_id": "c", "prompt": "x", "strength": 0}, 400, "strength: expected a number in (0, 1] or null, "
         "got 0"),
        ({"client_id": "c", "prompt": "x", "jpeg_quality": 96}, 400, "jpeg_quality: expected an integer 1..95, "
         "got 96"),
        ({"client_id": "c", "prompt": "x", "jpeg": 1}, 400, "jpeg: expected true or false, got 1"),
        ({"client_id": "c", "prompt": "x", "start_image": "%%%"}, 400, "start_image: expected a base64 PNG or "
         "JPEG: not valid base64"),
        ({"client_id": "c", "prompt": "x", "start_image": base64.b64encode(b"GIF89a").decode()}, 400,
         "start_image: expected a base64 PNG or JPEG: neither signature found"),
        ({"client_id": "c", "prompt": "x", "start_image": base64.b64encode(PNG).decode(), "strength": 0.5}, 400,
         "strength: video to video restyles input frames; a start image is for image to video: give one or the "
         "other"),
    ]  # fmt: skip
    for body, status, text in cases:
        assert refused(check_open, body) == (status, text), body


def test_a_start_image_may_come_as_a_data_url_and_is_bounded():
    assert decode_image_field("data:image/png;base64," + base64.b64encode(PNG).decode(), "start_image") == PNG
    too_big = base64.b64encode(PNG + b"\0" * 40).decode()
    assert refused(decode_image_field, too_big, "start_image", 32) == (
        413,
        "start_image: image larger than 32 B",
    )


def test_control_bodies():
    assert check_control({"prompt": "y", "recache": True, "at_chunk": 3}).__dict__ == {
        "kind": "prompt", "value": "y", "recache": True, "at_chunk": 3,
    }  # fmt: skip
    assert check_control({"strength": None}).value is None
    assert check_control({"stop": True}).kind == "stop"
    assert refused(check_control, {}) == (400, "control: expected exactly one of prompt, strength, seed, stop; "
                                          "got none")  # fmt: skip
    assert refused(check_control, {"seed": 2**63}) == (400, "seed: expected an integer 0..9223372036854775807, "
                                                       "got 9223372036854775808")  # fmt: skip
    assert refused(check_control, {"speed": 1}) == (400, "speed: unknown field; expected prompt, recache, "
                                                    "strength, seed, stop, at_chunk")  # fmt: skip


def test_frames_bodies():
    encoded = base64.b64encode(PNG).decode()
    assert check_frames({"frames": [encoded, encoded]}) == [PNG, PNG]
    assert refused(check_frames, {"frames": []}) == (400, "frames: expected a non-empty list of base64 PNG or "
                                                     "JPEG images")  # fmt: skip
    assert refused(check_frames, {"frames": [encoded, "x"]})[1].startswith("frames[1]: ")
    assert refused(check_frames, {"frames": [encoded] * 3}, 2) == (
        413,
        "frames: 3 frames in one body; at most 2",
    )
