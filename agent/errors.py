"""Every exception the agent raises on purpose, in one place.

Each one carries a message a person can act on: what was expected, what was found, and where.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of all deliberate agent errors; the CLI prints these as one line and exits non-zero."""


class UsageError(AgentError):
    """The command line asks for something refused as given (exit 2)."""


class ConfigError(AgentError):
    """A config file is malformed: the message names the file and the key."""


class BundleError(AgentError):
    """A model bundle failed a check: the message names the file and the check."""


class ArchiveError(BundleError):
    """A bundle archive is unsafe or corrupt (traversal, links, oversized member, truncated)."""


class ContractError(BundleError):
    """A variant's ONNX inputs/outputs disagree with the manifest's declared contract."""


class QualityError(BundleError):
    """`bundle create` measured an INT8 variant below the configured quality bound."""


class PreprocessError(AgentError):
    """A raw frame does not fit the bundle's preprocessing (wrong size, channels or dtype)."""


class ProviderError(AgentError):
    """A requested execution provider is unknown or not usable on this device."""


class SelectionError(AgentError):
    """No candidate passed the self-test; the message carries every rejection reason."""


class ResultTooLargeError(AgentError):
    """A decoded result is over the configured message size (output.max_result_bytes): counted, not published."""


class StageOutputError(AgentError):
    """A post graph's outputs are not what its result kind takes (a missing field, a wrong rank, lengths that
    disagree, non-finite values): counted, not published; the message names the stage and the field."""


# Raised by one module each, kept here so every deliberate exception is found in one file (issue 18); each keeps
# the base class its callers catch (ValueError, FloatingPointError, Exception).
class SignatureError(BundleError):
    """Unsigned, unknown key, or a signature that does not verify."""


class PayloadError(ValueError):
    """A message from outside is too large, too deep, not JSON or not a JSON object."""


class UpdateRejected(AgentError):
    """An update was refused; the message is the reason published on update/status."""


class CommandRefused(ValueError):
    """An `update` or `rollback` command whose payload the update machine cannot take; its text is the reply's
    `error` (agent.updates.commands)."""


class UrlRefused(ValueError):
    """An update URL the downloader refuses to fetch (its scheme, host or form)."""


class BadFrame(Exception):
    """One frame could not be turned into the frame the bundle expects; counted and skipped."""


class UndecodableFrame(PreprocessError):
    """A frame whose decoding was deferred to the preprocessing stage turned out not to decode."""


class NonFiniteOutput(FloatingPointError):
    """An output tensor holds NaN or inf."""


def install_hint(extra: str, package: str) -> str:
    """How to install an optional dependency. `edge-agent` on the public package index is another project, so a
    hint never names it: the extra is installed from a checkout (pyproject.toml's extras), or the one package."""
    return f"pip install '.[{extra}]' from an edge-agent checkout (or pip install {package})"


class SwapRefused(AgentError):
    """A running pipeline cannot take this engine in place (its source was opened for another sensor frame):
    the caller starts a pipeline for it, as at boot."""


class Stopping(AgentError):
    """The controller's loop has ended: a `call` posted now is never run."""


class Busy(AgentError):
    """The event is not allowed in the current state: another update holds the machine."""


class SimulatedCrash(Exception):
    """The simulated process died in the middle of an update (not an AgentError: nothing catches it)."""


class RolloutError(AgentError):
    """A rollout command that cannot go on; the message says why and what to do."""
