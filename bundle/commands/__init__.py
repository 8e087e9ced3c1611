"""The commands that read bundles, one module each (`configure(parser)`, `run(args) -> int`): `show`,
`lint`, `diff`, `baseline`, `profile`, `keygen`, `verify`, `attestation`. They need neither BCC nor
root; the recording commands are agent/commands/. The modules they drive (bundle/lint.py, diff.py,
show.py, baseline.py, policy/profile.py, ...) know nothing of argparse."""
