"""Every MQTT topic the agent and its operators use, defined once.

Prefix default `edge/<device_id>/`; docs/reference/topics.md is generated from `Topics.documented()`.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "edge"


def default_prefix(device_id: str) -> str:
    return f"{ROOT}/{device_id}/"


@dataclass(frozen=True)
class Topics:
    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix.endswith("/"):
            object.__setattr__(self, "prefix", self.prefix + "/")

    @property
    def availability(self) -> str:
        return self.prefix + "availability"

    @property
    def health(self) -> str:
        return self.prefix + "health"

    @property
    def selftest(self) -> str:
        return self.prefix + "selftest"

    @property
    def predictions(self) -> str:
        return self.prefix + "predictions"

    def source_predictions(self, source: str) -> str:
        """With many sources (`sources:`), each source's results on its own topic."""
        return self.prefix + f"predictions/{source}"

    def stream_predictions(self, stream: str) -> str:
        """A sensor stream of its own (a UDP sender, `<source>/<host>:<port>`): its results on its own topic.
        MQTT's wildcards cannot be in a topic name: a source name holding one has it replaced by '_'."""
        return self.prefix + "predictions/" + stream.replace("+", "_").replace("#", "_").replace("\0", "_")

    def source_health(self, source: str) -> str:
        return self.prefix + f"health/{source}"

    def snapshot(self, source: str) -> str:
        """A source's annotated JPEG, published on request (cmd/snapshot), as Frigate's snapshot topics."""
        return self.prefix + "snapshot/" + source.replace("+", "_").replace("#", "_").replace("\0", "_")

    @property
    def bundle_offer(self) -> str:
        return self.prefix + "bundle/offer"

    def bundle_chunk(self, transfer: str, index: int) -> str:
        return self.prefix + f"bundle/chunk/{transfer}/{index}"

    @property
    def bundle_done(self) -> str:
        return self.prefix + "bundle/done"

    @property
    def bundle_all(self) -> str:
        """Subscription filter for the whole transfer protocol."""
        return self.prefix + "bundle/#"

    @property
    def facts(self) -> str:
        """Retained: what a fleet rollout targets on and gates with (agent.fleet.facts)."""
        return self.prefix + "facts"

    @property
    def update_status(self) -> str:
        return self.prefix + "update/status"

    @property
    def commands(self) -> str:
        """Subscription filter for every command."""
        return self.prefix + "cmd/+"

    def command(self, name: str) -> str:
        return self.prefix + f"cmd/{name}"

    def reply(self, name: str) -> str:
        return self.prefix + f"cmd/{name}/reply"

    def command_name(self, topic: str) -> str | None:
        head = self.prefix + "cmd/"
        if not topic.startswith(head):
            return None
        name = topic[len(head) :]
        return name if name and "/" not in name else None

    @staticmethod
    def documented() -> dict[str, str]:
        """Topic suffixes and their meaning, as docs/reference/topics.md lists them."""
        return {
            "availability": "retained JSON {state: online|stopped|offline, session}; offline is the last will",
            "health": "retained JSON, every output.health_interval_s and on change",
            "selftest": "retained JSON: the full self-test report",
            "predictions": "one JSON result per message (QoS 1 by default), or a list when batching (one source)",
            "predictions/<source>": "the same, per source, when the config lists `sources:`",
            "predictions/<stream>": "the same, per sensor stream of its own (a UDP sender: `<source>/<host>:<port>`,"
                                    " at most source.max_streams at once), with one source or many",
            "health/<source>": "retained JSON: one listed source's state, counters, frame age and decoder",
            "cmd/<name>": "commands: status, selftest, reload, pause, resume, snapshot (update, rollback: docs/updates.md)",
            "cmd/<name>/reply": "command replies (MQTT 5 response topic + correlation data are honoured too)",
            "snapshot/<source>": "on cmd/snapshot only: the source's latest served frame with its result drawn, one"
                                 " JPEG (at most 1 MiB; QoS 1, not retained); the reply names the topic",
            "bundle/offer": "a pushed bundle's offer: transfer id, name, version, size, sha256, chunk size",
            "bundle/chunk/<transfer>/<index>": "the bundle's bytes, in chunks",
            "bundle/done": "the pusher has sent every chunk; the agent answers missing chunks or goes on",
            "update/status": "retained JSON: each step of an update, its final verdict and reason",
            "facts": "retained JSON: versions, providers, current/committed bundle, last rollback, proof figures, labels",
        }
