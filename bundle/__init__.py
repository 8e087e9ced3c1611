"""The evidence bundle: format, writer, reader, lint and diff. Pure Python: no BCC, no root."""
