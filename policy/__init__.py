"""Policy: the model (model.py), Landlock for files (landlock.py), cgroup connect/sendmsg programs
for the network (connect.py), environment scrubbing (env.py), the private tmp (tmp.py), a private
network namespace (netns.py) and `evidence profile` (profile.py). Only connect.py needs BCC, and
only when a guard is loaded. docs/policy-format.md describes the format."""
