// evidence recorder probes: exec, fork, exit, open, file changes, connect, chdir, dup, and namespace, mount and ptrace calls of tracked cgroups.
//
// Rendered by probes/render.py, which replaces every UPPERCASE token below with a number
// (struct offsets come from the running kernel's BTF, never from the installed headers), and
// `#include "abi.h"` with the kernel/user ABI: the record kinds (EV_*, K_*), flags (F_*),
// operations (CH_*, NS_*) and the records' layouts, defined once in probes/abi.py.
// Only tracepoint arguments, BPF helpers and BTF-derived offsets are used.
//
// The programs are in files by concern, joined into one text by render.py in the order of the
// `#include "..."` lines below (each file once; BCC compiles one text, and every program shares the
// maps and the inline helpers declared before it): shared helpers in bpf/lib/*.h, the programs of
// each concern in bpf/*.bpf.c (Tetragon's bpf/lib plus per-concern program files).
//
// Events go to one ring buffer as records that start with struct hdr. Opens, file changes,
// connects, sends, chdir, fchdir and dup are paired in the kernel: the enter handler keeps the call's arguments
// (and the path or address, read at entry) in `inflight`, per thread, and the exit handler emits
// ONE record with the result. exec keeps three records: the attempt with its argv (EV_EXEC), the
// success (EV_EXEC_OK, sched_process_exec) and the result (EV_RET), paired in user space. A failed
// ring buffer reservation is counted in `lost`, per run slot and event kind: nothing is dropped
// silently. For a run whose command rules are enforced, exec_check (bpf/exec_check.bpf.c, attached
// only once a run asks for it) kills an exec that loaded or copied what its supervisor did not decide.

#include "bpf/lib/common.h"
// generated: the ABI (probes/abi.py render_header)
#include "abi.h"
#include "bpf/lib/maps.h"
#include "bpf/lib/hash.h"
#include "bpf/lib/task.h"
#include "bpf/lib/emit.h"
#include "bpf/lib/calls.h"
#include "bpf/lib/paths.h"
#include "bpf/settle.bpf.c"
#include "bpf/names.bpf.c"
#include "bpf/exit.bpf.c"
#include "bpf/opens.bpf.c"
#include "bpf/exec.bpf.c"
#include "bpf/exec_check.bpf.c"
#include "bpf/process.bpf.c"
#include "bpf/sigsys.bpf.c"
#include "bpf/network.bpf.c"
#include "bpf/descriptors.bpf.c"
#include "bpf/changes.bpf.c"
#include "bpf/namespaces.bpf.c"
#include "bpf/dns.bpf.c"
#include "bpf/dns_ingress.bpf.c"
