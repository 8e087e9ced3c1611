"""The privileged side of evidence (root and BCC): the recorder, the daemon, and the command-line
clients that drive them. Install with the `agent` extra: `pip install 'evidence[agent]'`."""
