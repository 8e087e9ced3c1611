"""The daemon (`evidence agent`): the control API, the backend over one recorder, delivery of
bundles and live events, Kubernetes pods, metrics and settings."""
