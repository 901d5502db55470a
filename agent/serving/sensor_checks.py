"""What `config check` and the boot refuse about a sensor source for a bundle (one line each, the same words):
a stateful bundle on a source that cannot keep its contract, and declared senders the bundle's frame does not
take (rate, channels, sample format, hop)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from agent.config import SourceConfig
from agent.serving.sensor_mqtt import topic_filter_problem
from agent.source_types import MqttSourceConfig, SampleKeys
from agent.vocabulary.manifest import FrameSpec


def stateful_lossy_message(where: str = "source") -> str:
    return (f"{where}.lossless: false drops windows, but the bundle carries state (inputs with kind: state): a "
            "stateful model must see every window of a stream in order. Remove source.lossless (stateful bundles "
            "default to lossless) or serve a stateless bundle")


def declared_mismatch(frame: FrameSpec, cfg: SourceConfig, key: str = "source") -> str | None:
    """Why what the source declares its senders send (sample rate, channels) is not what the bundle takes:
    the answers would change (8 kHz audio through a 16 kHz model is served wrong, without an error)."""
    if not isinstance(cfg, SampleKeys):
        return None
    if cfg.sample_rate and cfg.sample_rate != frame.sample_rate:
        takes = f"{frame.sample_rate:g} samples/s" if frame.sample_rate else "no declared sample rate"
        return (f"key {key}.sample_rate: the senders send {cfg.sample_rate:g} samples/s but the bundle's frame takes "
                f"{takes} (input.frame.sample_rate): resample before sending, or serve a bundle built for this rate")
    if cfg.channels and cfg.channels != frame.channels:
        return (f"key {key}.channels: the senders send {cfg.channels} channels but the bundle's frame takes "
                f"{frame.channels} (input.frame.channels)")
    if cfg.sample_dtype and _rescaled(np.dtype(cfg.sample_dtype), np.dtype(frame.dtype)):
        # samples are cast, never rescaled: 16-bit PCM into a float frame reaches the model as -32768..32767
        return (f"key {key}.sample_dtype: the senders send {cfg.sample_dtype} samples but the bundle's frame takes "
                f"{frame.dtype} (input.frame.dtype): they would reach the model cast, not rescaled (16-bit PCM "
                f"as -32768..32767 where [-1, 1] is meant); send {frame.dtype} samples, or remove "
                f"{key}.sample_dtype")
    if frame.stateful and cfg.hop and cfg.hop != frame.step:
        # the state advances once per hop the model was built for: another hop feeds samples to it twice (or
        # skips them), and every answer changes
        return (f"key {key}.hop: {cfg.hop} samples, but the bundle carries state (inputs with kind: state) built "
                f"for its frame's hop of {frame.step} (input.frame.hop): remove {key}.hop, or serve a stateless "
                "bundle")
    return None


def _rescaled(sent: np.dtype, takes: np.dtype) -> bool:
    """Whether samples of `sent` cast to `takes` would change their meaning: integer PCM into a float frame (full
    scale 32767 where 1.0 is meant) or floats into an integer one (truncated to 0, +-1)."""
    return (sent.kind == "f") != (takes.kind == "f")


def mqtt_stateful_message(where: str = "source") -> str:
    return (f"key {where}.type: mqtt cannot keep a stateful bundle's contract (inputs with kind: state) with payload "
            "image, npy or raw: its frames are latest-frame-wins whole windows, with no stream time, so windows would "
            f"be dropped and the state carried across the hole; set {where}.payload: samples (the topic's payloads "
            "are the stream's samples, windows cut in stream time), or send over udp, a FIFO (file) or stdin")


def stream_problems(frame: FrameSpec, inputs: Sequence[Any], sources: Sequence[SourceConfig],
                    keys: Sequence[str]) -> list[str]:
    """What `config check` refuses about serving this bundle's frames from these sources."""
    out = []
    states = [f"inputs[{i}] ({x.name}, kind: state)" for i, x in enumerate(inputs) if x.kind == "state"]
    for key, src in zip(keys, sources):
        if states and isinstance(src, MqttSourceConfig) and src.payload != "samples":
            out.append(mqtt_stateful_message(key))
        if states and isinstance(src, MqttSourceConfig) and src.payload == "samples" and src.framing != "seq32":
            out.append(mqtt_unframed_message(key))
        if isinstance(src, MqttSourceConfig) and (why := topic_filter_problem(src, key)) is not None:
            out.append(why)
        if states and src.lossless is False:
            out.append(f"key {key}.lossless: false with a stateful bundle ({', '.join(states)}): windows would be "
                       "dropped and the state carried across the hole; remove the key (stateful bundles default to "
                       "lossless)")
        if frame.kind == "sensor" and src.delivers() == "sensor":
            why = declared_mismatch(frame, src, key)
            if why is not None:
                out.append(why)
    return out


def mqtt_unframed_message(where: str = "source") -> str:
    return (f"key {where}.framing: none with mqtt payload: samples into a bundle with state: a broker drops QoS 1 "
            "messages queued beyond its limit for a subscriber that is behind (Mosquitto's max_queued_messages, "
            "1000 by default) without a word, and unnumbered payloads cannot show the hole, so the state would be "
            f"carried across it; set {where}.framing: seq32 and number the payloads (each starts with its uint32 "
            "sequence number: a dropped payload is counted and resets the state), or send over udp with seq32, "
            "a FIFO (file) or stdin")
