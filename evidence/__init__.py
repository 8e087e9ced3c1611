"""evidence: an eBPF run recorder."""

__version__ = "0.1.0"
