"""Home Assistant MQTT discovery: one device with sensors for fps, latency, provider, verdict and the
last prediction (per source, with its state and frame age, when the config lists `sources:`), all read
from the agent's own health and predictions topics."""

from __future__ import annotations

import json
from typing import Any

from agent import __version__
from agent.config import Config
from agent.link.topics import Topics


def discovery_messages(cfg: Config, topics: Topics) -> dict[str, bytes]:
    dev_id = cfg.device_id.replace("/", "_")
    device = {"identifiers": [f"edge-agent-{dev_id}"], "name": f"edge-agent {cfg.device_id}",
              "manufacturer": "edge-agent", "sw_version": __version__}
    availability = {"topic": topics.availability, "value_template": "{{ value_json.state }}",
                    "payload_available": "online", "payload_not_available": "offline"}
    sensors: dict[str, dict[str, Any]] = {
        "fps": {"name": "Frames per second", "state_topic": topics.health,
                "value_template": "{{ value_json.pipeline.fps_out }}", "unit_of_measurement": "fps"},
        "latency_p95": {"name": "Latency p95", "state_topic": topics.health, "unit_of_measurement": "ms",
                        "value_template": "{{ value_json.pipeline.latency_ms.total.p95 if value_json.pipeline.latency_ms.total is defined else 0 }}"},
        "provider": {"name": "Execution provider", "state_topic": topics.health,
                     "value_template": "{{ value_json.provider.effective[0] if value_json.provider else 'none' }}"},
        "verdict": {"name": "Self-test", "state_topic": topics.health,
                    # health's one word (pass, degraded, fail): a device serving degraded is not "pass", nor "fail"
                    "value_template": "{{ value_json.selftest.verdict if value_json.selftest.verdict is defined "
                                      "else 'none' }}"},
        "last_prediction": {"name": "Last prediction", "state_topic": topics.predictions,
                            "value_template": _last_prediction_template()},
    }
    if cfg.sources:  # many sources: results go to predictions/<source>; entities per source
        sensors.pop("last_prediction")
        for src in cfg.sources:
            name = str(src.name)
            sensors[f"last_prediction_{name}"] = {
                "name": f"{name} last prediction", "state_topic": topics.source_predictions(name),
                "value_template": _last_prediction_template()}
            sensors[f"source_state_{name}"] = {"name": f"{name} state", "state_topic": topics.source_health(name),
                                               "value_template": "{{ value_json.state }}"}
            sensors[f"frame_age_{name}"] = {"name": f"{name} last frame age", "state_topic": topics.source_health(name),
                                            "unit_of_measurement": "s",
                                            "value_template": "{{ value_json.last_frame_age_s }}"}
    out = {}
    for key, s in sensors.items():
        config = {**s, "unique_id": f"edge_agent_{dev_id}_{key}", "device": device, "availability": [availability]}
        out[f"{cfg.mqtt.homeassistant_prefix}/sensor/edge_agent_{dev_id}/{key}/config"] = json.dumps(config).encode()
    return out


def _last_prediction_template() -> str:
    return "{{ (value_json.result.top[0].label) if value_json.result.top is defined else value_json.result.type }}"
