"""The BPF C programs (record.bpf.c, which lists its parts in bpf/lib/*.h and bpf/*.bpf.c, and
connect_guard.bpf.c: package data), the kernel/user ABI they share with user space (abi.py), the
pure code that renders them (render.py), and the code that loads them (loader.py, guard.py; with
BCC only to compile, objcache.py; the bpf(2) layer, bpfsys.py; needs root). Nothing here imports
agent/, policy/ or bundle/."""
