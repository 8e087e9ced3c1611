"""The recorder: probes loaded once, ring-buffer records decoded and correlated per run, cgroups,
enforcement and the command launcher, spools and bundles."""
