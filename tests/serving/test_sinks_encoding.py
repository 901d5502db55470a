"""Results are encoded once, by the fast encoder where installed, into the same JSON the standard one writes."""

from __future__ import annotations

import io
import json

from agent.serving import sinks
from agent.serving.sinks import FanOutSink, JsonLinesSink, OutboxSink, encode_json

RESULT = {
    "boot": 3, "seq": 12345, "captured_at": 1764624000.123456, "source": "cam-é", "frame_index": 7,
    "bundle": {"name": "layout", "version": 2}, "variant": "int8", "provider": "CPUExecutionProvider", "batch": 1,
    "timings": {"queue_ms": 1.234, "preprocess_ms": 0.5, "inference_ms": 0.77, "postprocess_ms": 0.05, "total_ms": 3.1},
    "result": {"regions": [{"label": "text", "index": 1, "score": 0.912345678, "box": [1.5, 2.0, 300.25, 1e-7]}],
               "top": [{"label": "7", "index": 7, "score": 1.0}], "empty": []},
}


class Outbox:
    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes, int]] = []

    def put(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self.puts.append((topic, payload, qos))


def test_the_fast_encoder_writes_what_the_standard_one_means() -> None:
    assert json.loads(encode_json(RESULT)) == RESULT
    assert json.loads(encode_json([RESULT, RESULT])) == [RESULT, RESULT]


def test_without_orjson_the_standard_encoder_writes_compact_json(monkeypatch) -> None:
    monkeypatch.setattr(sinks, "orjson", None)
    assert encode_json(RESULT) == json.dumps(RESULT, separators=(",", ":")).encode()


def test_stdout_and_the_outbox_get_one_encoding_of_each_result() -> None:
    out, box = io.StringIO(), Outbox()
    fan = FanOutSink(JsonLinesSink(out), OutboxSink(box, "predictions"))
    fan.write(RESULT)
    fan.close()
    line = out.getvalue()
    assert line.endswith("\n") and json.loads(line) == RESULT
    assert len(box.puts) == 1 and box.puts[0][1] == line[:-1].encode()  # the same bytes, encoded once
