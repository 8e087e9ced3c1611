"""Policy: the model (model.py), Landlock for files (landlock.py), the network rules as the tables of
the cgroup connect/sendmsg programs (connect.py; probes/guard.py loads them), environment scrubbing
(env.py), the private tmp (tmp.py), a private network namespace (netns.py) and `evidence profile`
(profile.py). Nothing here needs BCC. docs/policy-format.md describes the format."""
