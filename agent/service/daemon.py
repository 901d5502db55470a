"""`edge-agent run`: the demo config, and the agent itself (the controller in `agent.service.controller`).

Nothing is served from an unproven setup: when the self-test selects nothing (or the bundle does not
load), the agent stays up, not serving, and says why, so a new bundle or command can still reach it.
"""

from __future__ import annotations

from pathlib import Path

from agent.config import Config, SelectionConfig, user_state_dir
from agent.source_types import FolderSourceConfig
from agent.errors import ConfigError
from agent.service.controller import COMMANDS, Controller

DEMO_BUNDLE = Path("models/digits-classifier")
DEMO_FRAMES = Path("models/demo-frames/digits")

Agent = Controller  # the name the CLI and older callers use

__all__ = ["Agent", "COMMANDS", "Controller", "demo_config"]


def demo_config() -> Config:
    """The config `edge-agent run` uses without --config: the demo bundle on the demo frames.

    A demo serves: on a machine too slow or too busy for the bundle's 50 ms p95 budget it serves the fastest
    proven candidate marked DEGRADED (selection.when_too_slow: degraded), where a device's config keeps the
    default (none: nothing too slow serves). Reproduction and fidelity are never relaxed."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / DEMO_BUNDLE / "bundle.yaml").exists() and (root / DEMO_FRAMES).is_dir():
            return Config(
                state_dir=user_state_dir(),
                bundle=root / DEMO_BUNDLE,
                source=FolderSourceConfig(path=root / DEMO_FRAMES),
                selection=SelectionConfig(when_too_slow="degraded"),
            )
    raise ConfigError(
        f"no --config given and no demo found ({DEMO_BUNDLE} and {DEMO_FRAMES}): "
        "run from the repository root or pass --config FILE"
    )
