"""The BPF C programs (`*.bpf.c`, package data), the pure code that renders them, and the only code
that loads them with BCC (needs root)."""
