"""``nc_paced``: the kernel congestion control the hub's bulk connections run where it can be
loaded, so that what paces their replies is the spoke's controller and nothing else.

The hub's kernel moves the bulk replies, and its own congestion control shapes them on top of
the rate the spoke asks for (``PacingLimit``). The kernel's BBR enters PROBE_RTT every 10 s
(4 segments in flight for two round trips: 1.8 s at 900 ms) and its loss recovery holds the
window to the packets in flight; on a lossy 900 ms path that cost a fifth of the link
(docs/transport.md, "The hub kernel's PROBE_RTT"). ``nc_paced`` (``nc_paced.bpf.c``, next to
this file) only follows the rate it is given: its window is twice the rate times the smoothed
RTT whatever is lost, and it paces at the cap. The kernel still repairs losses.

It is a BPF ``struct_ops`` program: compiled at load time with clang against the running
kernel's BTF (``bpftool btf dump``) and registered with ``bpftool struct_ops register``, which
needs root (CAP_BPF and CAP_NET_ADMIN). Registration lasts until reboot or
``bpftool struct_ops unregister name nc_paced``, and every network namespace sees it. Loading
also adds it to ``net.ipv4.tcp_allowed_congestion_control``, so that a hub running as an
unprivileged user (the systemd unit's) may choose it once root has loaded it
(``neuralcache kernel-cc``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .tcp import available_congestion_controls

log = logging.getLogger(__name__)

NAME = "nc_paced"
"""The name the program registers (``TCP_CONGESTION``)."""

SOURCE = Path(__file__).with_name("nc_paced.bpf.c")

ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
"""The controls a process without CAP_NET_ADMIN may set (one list for every network
namespace)."""

KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
"""The running kernel's type information, which the program is compiled against."""

AUTO = "auto"
"""``--tcp-congestion`` default: ``nc_paced`` if it can be loaded, else ``FALLBACK``, said in the
log and in ``neuralcache_hub_bulk_congestion_control``."""

FALLBACK = "bbr"
"""The kernel's own control used when ``nc_paced`` cannot be loaded: it does not read random loss
as congestion, though its PROBE_RTT and recovery cost long lossy paths."""

TOOLS = ("clang", "bpftool")
"""What loading needs on the PATH (Debian: ``apt-get install clang bpftool libbpf-dev``; the
last for ``bpf_helpers.h``)."""

TOOL_TIMEOUT = 60.0
"""Seconds a build or registration step may take (both take under a second here)."""


class KernelCCError(RuntimeError):
    """``nc_paced`` could not be loaded; the message says why and what would fix it."""


def loaded() -> bool:
    """Whether the kernel offers ``nc_paced`` now."""
    return NAME in available_congestion_controls()


def _run(argv: list[str], *, stdout: Path | None = None) -> None:
    try:
        if stdout is None:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT)
        else:
            with stdout.open("w") as out:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, text=True,
                                      timeout=TOOL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelCCError(f"{argv[0]} failed: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or "").strip().splitlines()
        raise KernelCCError(f"`{' '.join(argv[:3])} ...` exited {done.returncode}: "
                            f"{detail[-1] if detail else 'no message'}")


def _allow() -> None:
    """Let processes without CAP_NET_ADMIN choose ``nc_paced``: as root, add it to the allowed
    list; otherwise raise ``KernelCCError`` unless it is there already."""
    try:
        allowed = ALLOWED_CC.read_text().split()
    except OSError as exc:
        raise KernelCCError(f"cannot read {ALLOWED_CC}: {exc}") from exc
    if NAME in allowed:
        return
    if os.geteuid() != 0:
        raise KernelCCError("it is loaded but not allowed for this user: run `neuralcache "
                            "kernel-cc` as root first")
    try:
        ALLOWED_CC.write_text(" ".join([*allowed, NAME]))
    except OSError as exc:
        log.warning("cannot add %s to %s (%s): only root may use it", NAME, ALLOWED_CC, exc)


def load() -> None:
    """Compile ``nc_paced`` for the running kernel, register it and allow it; nothing but the
    last if it is registered. Raises ``KernelCCError`` with the reason if it cannot be."""
    if not loaded():
        _build_and_register()
    _allow()


def _build_and_register() -> None:
    if os.geteuid() != 0:
        raise KernelCCError("loading it needs root: run `neuralcache kernel-cc` as root first")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise KernelCCError(f"{' and '.join(missing)} not found "
                            f"(Debian: apt-get install clang bpftool libbpf-dev)")
    if not KERNEL_BTF.exists():
        raise KernelCCError(f"the kernel has no BTF ({KERNEL_BTF}; CONFIG_DEBUG_INFO_BTF)")
    with tempfile.TemporaryDirectory(prefix="nc_paced-") as tmp:
        header, obj = Path(tmp) / "vmlinux.h", Path(tmp) / "nc_paced.bpf.o"
        _run(["bpftool", "btf", "dump", "file", str(KERNEL_BTF), "format", "c"], stdout=header)
        _run(["clang", "-O2", "-g", "-target", "bpf", f"-I{tmp}", "-c", str(SOURCE),
              "-o", str(obj)])
        try:
            _run(["bpftool", "struct_ops", "register", str(obj)])
        except KernelCCError:
            if loaded():  # another hub registered it meanwhile
                return
            raise
    if not loaded():
        raise KernelCCError(f"registered, but the kernel does not list {NAME}")


def bulk_congestion(requested: str) -> str:
    """The TCP congestion control for the hub's bulk connections, from ``--tcp-congestion``:
    ``auto`` loads ``nc_paced`` or, if it cannot, warns why and uses ``FALLBACK``; ``nc_paced``
    loads it or raises ``KernelCCError``; any other name is used as given."""
    if requested not in (AUTO, NAME):
        return requested
    try:
        load()
    except KernelCCError as exc:
        if requested == NAME:
            raise
        log.warning("hub: cannot load the %s congestion control (%s); bulk replies are paced "
                    "by the kernel's %s, whose PROBE_RTT and loss recovery cost long lossy "
                    "paths (docs/transport.md)", NAME, exc, FALLBACK)
        return FALLBACK
    return NAME
