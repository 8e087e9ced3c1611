"""One error hierarchy for the whole tool; every subclass knows its exit code and a hint."""

from __future__ import annotations

# Exit codes (documented in README.md). The command's own exit code passes through `evidence run`.
EXIT_OK = 0
EXIT_FINDINGS = 1  # lint/diff found something at or above --fail-on
EXIT_ERROR = 2  # bad input, verification failure, policy cannot be enforced with --fail-closed
EXIT_WOULD_BLOCK = 4  # --dry-run: something would have been blocked
EXIT_WALL = 124  # run: the policy's limits.wall was reached and the run killed (as timeout(1))
EXIT_SETUP = 70  # the recorder could not start (kernel, permissions): nothing was run


class Error(Exception):
    """Base class: a one-line message for the user, plus what to do about it."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def diagnostics(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(Error):
    """The command line or an input file is wrong."""


class BundleError(Error):
    """A bundle failed verification or could not be read."""


class PolicyError(Error):
    """A policy file is invalid, or cannot be enforced here."""


class SetupError(Error):
    """The recorder cannot run on this machine (missing privilege, kernel feature, headers)."""

    exit_code = EXIT_SETUP


# the `agent` extra's modules (pyproject.toml): recording needs them, the verifier and the clients
# (`start`, `finish`, `run --agent`) do not
AGENT_EXTRA = frozenset({"cloudevents", "pydantic_settings", "pyroute2", "prometheus_client"})


def extra_error(command: str | None, missing: str) -> SetupError:
    what = f"evidence {command}" if command else "this command"
    return SetupError(
        f"{what} needs the agent extra ({missing} is not installed): pip install 'evidence[agent]'"
    )


def require_agent_extra(command: str) -> None:
    """Raise a one-line SetupError when a module of the `agent` extra is missing. The clients
    (`start`, `finish`, `run --agent`) need none of it: they run in job containers."""
    import importlib.util

    for name in sorted(AGENT_EXTRA):
        if importlib.util.find_spec(name) is None:
            raise extra_error(command, name)
