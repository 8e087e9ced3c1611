"""The commands over signed bundles: `keygen`, `verify` and `attestation` (one module each)."""
