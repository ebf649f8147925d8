"""Shared storage for the peer-memory benchmark: a file server on a node of its own, so that a
restore from storage crosses the data link as it does on a cluster whose checkpoints sit on a
network file system.

The server is OpenSSH's `sshd` (its built-in SFTP) in the storage node's network namespace; the
restoring rank reads through `sshfs`, the kernel's FUSE, mounted in a mount namespace of its own
inside its node's network namespace. This machine's kernel has no NFS client (FUSE is what it
has). SFTP is not NFS or Lustre, so the benchmark measures this storage's own raw speed beside
the restore from it: a cold sequential read of the same file through the same mount. The cipher
is AES-GCM (the CPU's AES instructions), so that encryption is not what slows the storage.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relaunch.cluster.local import kill_tree

SSHD = Path("/usr/sbin/sshd")
PRIVILEGE_SEPARATION_DIR = Path("/run/sshd")
"""Where sshd chroots its unprivileged child; it refuses to start without it."""
CIPHER = "aes128-gcm@openssh.com"
LISTENING = "Server listening on"
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FileServer:
    """Where the storage node's server listens, and the key a client logs in with."""

    address: str
    key: Path


def unavailable() -> str | None:
    """Why there can be no file server here, or None."""
    missing = [
        name
        for name, found in (
            ("sshd (Debian's openssh-server)", SSHD.exists()),
            ("sshfs (Debian's sshfs)", shutil.which("sshfs") is not None),
            ("fusermount3 (Debian's fuse3)", shutil.which("fusermount3") is not None),
            ("/dev/fuse", Path("/dev/fuse").exists()),
        )
        if not found
    ]
    return f"shared storage needs {', '.join(missing)}" if missing else None


@contextlib.contextmanager
def file_server(namespace: str, address: str, scratch: Path) -> Iterator[FileServer]:
    """sshd on `address` in network namespace `namespace`, serving this machine's files to one
    key made for it (its keys and log under `scratch`); stopped when the block ends."""
    scratch.mkdir(parents=True, exist_ok=True)
    for name in ("host", "client"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(scratch / name)],
            check=True, capture_output=True,
        )  # fmt: skip
    authorized = scratch / "authorized_keys"
    authorized.write_text((scratch / "client.pub").read_text())
    PRIVILEGE_SEPARATION_DIR.mkdir(mode=0o755, exist_ok=True)
    options = {
        "ListenAddress": address, "HostKey": scratch / "host", "AuthorizedKeysFile": authorized,
        "StrictModes": "no", "PermitRootLogin": "prohibit-password", "UsePAM": "no",
        "PasswordAuthentication": "no", "Subsystem": "sftp internal-sftp", "PidFile": "none",
        "Ciphers": CIPHER,
    }  # fmt: skip
    args = [str(SSHD), "-D", "-e", "-f", "/dev/null"]
    for key, value in options.items():
        args += ["-o", f"{key}={value}"]
    log = scratch / "sshd.log"
    with open(log, "w") as out:
        server = subprocess.Popen(["ip", "netns", "exec", namespace, *args], stderr=out)
    try:
        _until_listening(server, log)
        yield FileServer(address, scratch / "client")
    finally:  # the listener and each connection's sshd (sessions of their own, its children)
        kill_tree(server.pid)
        server.wait()


def _until_listening(server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while LISTENING not in log.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the storage node's sshd did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


@contextlib.contextmanager
def mounted(server: FileServer, remote: Path) -> Iterator[Path]:
    """`remote` on the server, mounted read-only at a fresh directory (a fresh mount: none of its
    pages in the page cache) by an sshfs of ours, in the foreground. When the block ends the mount
    is detached (lazily: a restore's memory-mapped tensors may still hold the file) and that sshfs
    and its ssh are killed, so that nothing of them outlives the caller. Run it in a mount
    namespace of the caller's own (`ip netns exec` makes one): the mount is no other process's."""
    at = Path(tempfile.mkdtemp(prefix="relaunch-storage-"))
    options = ",".join(
        (
            "ro", f"IdentityFile={server.key}", "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null", "BatchMode=yes", f"Ciphers={CIPHER}",
            "Compression=no", "LogLevel=ERROR",
        )
    )  # fmt: skip
    # not our stdout: the benchmark reads that to its end
    sshfs = subprocess.Popen(
        ["sshfs", "-f", f"root@{server.address}:{remote}", str(at), "-o", options],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _until_mounted(sshfs, at)
        yield at
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(at)], check=False, capture_output=True)
        kill_tree(sshfs.pid)  # sshfs and its ssh
        sshfs.wait()
        with contextlib.suppress(OSError):
            at.rmdir()


def _until_mounted(sshfs: subprocess.Popen[str], at: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _mounted_at(at):
        if sshfs.poll() is not None or time.monotonic() > deadline:
            sshfs.kill()
            _, said = sshfs.communicate()
            raise RuntimeError(f"sshfs could not mount the shared storage: {said.strip()}")
        time.sleep(0.02)


def _mounted_at(at: Path) -> bool:
    """Whether the mount is there; not where its sshfs mounted it and died (the kernel then
    answers ENOTCONN: CI once saw it, the server refusing after the mount)."""
    try:
        return at.is_mount() and bool(at.stat())
    except OSError:
        return False
