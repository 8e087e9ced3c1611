"""The command-line clients: `run`, `run --agent`, `start`, `finish`, `doctor` and `agent`; each
module offers `configure(parser)` and `run(args) -> int` for evidence/cli.py."""
