"""Memory of this process: its resident set as Linux counts it, and the bytes TF's CPU allocator counts."""

from __future__ import annotations


def resident_bytes() -> dict[str, int | None]:
    """{"peak": VmHWM, "now": VmRSS} of this process in bytes, from /proc/self/status.

    VmHWM is the peak of this process image alone. Without /proc, "peak" falls back to getrusage's
    ru_maxrss (which keeps the parent's peak across fork+exec, so it can overstate a child's) and
    "now" is None.
    """
    try:
        with open("/proc/self/status") as f:
            status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Vm")}
        return {"peak": status["VmHWM"], "now": status["VmRSS"]}
    except (OSError, KeyError):
        import resource

        return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "now": None}


def tf_allocator_bytes(reset: bool = False) -> dict | None:
    """{"current", "peak"} bytes in TF's CPU allocator (None where TF keeps no statistics); `reset`
    starts a new peak after reading.

    With oneDNN (TF_ENABLE_ONEDNN_OPTS=1; TF's default only on CPUs with AVX-512 VNNI/BF16 or AMX), TF
    serves tensors of 256 KB and more from a BFC pool that counts them exactly; that pool grows in regions
    and never shrinks, so process RSS follows the pool's size (live tensors plus fragmentation) in steps of
    a region. With TF_ENABLE_ONEDNN_OPTS=0
    tensors come from malloc and TF keeps no statistics.
    """
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
        return info
    except ValueError:
        return None
