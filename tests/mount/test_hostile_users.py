"""A hostile job user against a root daemon: nothing outside the backing
directory, and nothing of root's inside it, may change or be read.

Two mounts of one backing directory stand for two nodes (mount B, and the
backing directory itself, stand for another node and a login node's NFS
mount). The user (uid 65534) owns a directory in the backing store, as the
Slurm prolog arranges, and swaps a directory, or a file's name, for a
symlink to a root-only target (or for a root-owned directory), before or
after the mount looked it up, then tries every namespace and attribute
operation through the stale inode: by path, within the kernel's entry
lifetime, and through a descriptor held from before the swap. After each
attempt the root-only tree outside is compared, byte for byte, with its
state before, and nothing the user read may be a root-only byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from manifests import manifest_body
from mounts import Mount, is_mounted

USER, GROUP = 65534, 65534

# The user's side: no ckptfs, no torch (a fresh interpreter per attempt).
PRELUDE = """
import errno, json, os, sys
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
os.umask(0o022)
args = json.loads(sys.argv[3])
read = []  # every byte the user got back, hex
def attempt(fn, *a, **kw):
    try:
        got = fn(*a, **kw)
        if isinstance(got, bytes):
            read.append(got.hex())
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
"""

# Operations on a directory ``d`` the user held (a dir fd ``dfd``, or the
# path ``p`` while the kernel's entry for it lives) and that now is swapped.
DIR_OPS = {
    "chmod": "attempt(os.chmod, dfd, 0o4777) if by_fd else attempt(os.chmod, p, 0o4777)",
    "chown": "attempt(os.chown, dfd, uid, gid) if by_fd else attempt(os.chown, p, uid, gid)",
    "utime": "attempt(os.utime, dfd, (1, 1)) if by_fd else attempt(os.utime, p, (1, 1))",
    "truncate": "attempt(os.truncate, at('victim'), 0)",
    "create": "attempt(lambda: os.close(os.open(at('new'), os.O_CREAT | os.O_WRONLY, 0o644)))",
    "create-over": "attempt(lambda: os.close(os.open(at('victim'), os.O_WRONLY | os.O_TRUNC)))",
    "mkdir": "attempt(os.mkdir, at('newdir'))",
    "symlink": "attempt(os.symlink, '/etc/passwd', at('lnk'))",
    "rename-within": "attempt(os.rename, at('victim'), at('moved'))",
    "rename-out": "attempt(os.rename, at('victim'), own + '/stolen')",
    "rename-in": "attempt(os.rename, own + '/mine', at('victim'))",
    "unlink": "attempt(os.unlink, at('victim'))",
    "rmdir": "attempt(os.rmdir, at('sub'))",
    "read": "attempt(lambda: open(at('secret'), 'rb').read())",
    "read-world": "attempt(lambda: open(at('victim'), 'rb').read())",
    "write": "attempt(lambda: open(at('victim'), 'r+b').write(b'pwned'))",
    "readdir": "attempt(lambda: json.dumps(os.listdir(dfd if by_fd else p)).encode())",
    "stat": "attempt(lambda: repr(os.stat(at('secret'))).encode())",
}

# Operations on a file the user held open (``fd``) or named (``p``), whose
# name now is a symlink to a root-only file.
FILE_OPS = {
    "chmod": "attempt(os.chmod, fd, 0o4777) if by_fd else attempt(os.chmod, p, 0o4777)",
    "chown": "attempt(os.chown, fd, uid, gid) if by_fd else attempt(os.chown, p, uid, gid)",
    "utime": "attempt(os.utime, fd, (1, 1)) if by_fd else attempt(os.utime, p, (1, 1))",
    "truncate": "attempt(os.truncate, fd if by_fd else p, 0)",
    "write": "attempt(os.pwrite, fd, b'pwned', 0) if by_fd else "
    "attempt(lambda: open(p, 'r+b').write(b'pwned'))",
    "read": "attempt(os.pread, fd, 1 << 16, 0) if by_fd else attempt(lambda: open(p, 'rb').read())",
    "unlink": "attempt(os.unlink, p)",
    "rename": "attempt(os.rename, p, own + '/renamed')",
}


def snapshot(top: Path) -> dict[str, Any]:
    """Every name under ``top`` with its type, mode, owner, times and bytes."""
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = os.lstat(path)
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(top))] = (
                st.st_mode,
                st.st_uid,
                st.st_gid,
                st.st_size,
                st.st_mtime_ns,
                digest,
            )
    return found


class Attack:
    """One mount pair, a root-only tree outside the backing directory, a
    root-owned directory inside the user's, and the user's own directory."""

    def __init__(self, make: Any) -> None:
        self.a: Mount = make("a")
        self.b: Mount = make("b")
        self.backing = self.a.backing
        self.top = self.backing / "u"
        self.top.mkdir()
        os.chown(self.top, USER, GROUP)
        self.rounds = 0
        self.root_dir_ino = 0
        self.own = self.top  # the current round's directory (reset_own)
        # Outside: root-only (0700), so the user cannot reach it itself.
        self.outside = Path(tempfile.mkdtemp(prefix="ckptfs-outside-", dir="/tmp"))
        self.outside.chmod(0o700)
        self.secrets: list[bytes] = []
        self._fill(self.outside / "dir")
        self._file(self.outside / "victim", 0o644)
        self.before = {"outside": snapshot(self.outside)}

    def _file(self, path: Path, mode: int) -> None:
        data = os.urandom(4096)  # random, non-periodic: found if leaked anywhere
        path.write_bytes(data)
        path.chmod(mode)
        self.secrets.append(data)

    def _fill(self, d: Path) -> None:
        d.mkdir()
        d.chmod(0o755)
        self._file(d / "victim", 0o644)
        self._file(d / "secret", 0o600)
        (d / "sub").mkdir()

    def _root_inside(self) -> tuple[Any, ...]:
        """Root's directory inside the user's (by whatever name the user
        moved it to): its own owner and mode, and everything in it."""
        for d in self.own.iterdir():
            st = os.lstat(d)
            if st.st_ino == self.root_dir_ino:
                return (st.st_mode, st.st_uid, st.st_gid, snapshot(d))
        raise AssertionError(f"root's directory is gone from {self.own}")

    def mount(self) -> None:
        for m in (self.a, self.b):
            m.mount()
        # Refusals of stale inodes are logged at INFO; nothing else may be.
        for m in (self.a, self.b):
            m.allowed_log = []

    def run(self, *parts: str, **args: Any) -> dict[str, Any]:
        """Run the script made of ``parts`` (each dedented) as the user."""
        code = PRELUDE + "".join(textwrap.dedent(part) for part in parts)
        proc = subprocess.run(
            [sys.executable, "-c", code, str(USER), str(GROUP), json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr + proc.stdout + self.a.log()[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def check(self, what: str, result: dict[str, Any]) -> None:
        assert snapshot(self.outside) == self.before["outside"], f"{what} changed the outside"
        assert self._root_inside() == self.before["root"], f"{what} changed root's directory"
        for blob in result.get("read", []):
            got = bytes.fromhex(blob)
            for secret in self.secrets:
                assert secret[:64] not in got, f"{what} read a root-only file: {result}"

    def reset_own(self) -> None:
        """A new directory of the user's for the next attempt (fresh names:
        no kernel entry of an earlier attempt's stands in), holding ``d``
        (theirs, with the names the operations use), ``mine``, and a
        directory of root's with a root-only file (``rootdir``)."""
        self.rounds += 1
        self.own = self.top / f"r{self.rounds}"
        self.own.mkdir()
        os.chown(self.own, USER, GROUP)
        # Inside the backing, but root's: a directory root left in the user's.
        self._fill(self.own / "rootdir")
        self.root_dir_ino = os.lstat(self.own / "rootdir").st_ino
        self.before["root"] = self._root_inside()
        self.run(
            """
            own = args["own"]
            os.mkdir(f"{own}/d")
            for name in ("victim", "secret"):
                with open(f"{own}/d/{name}", "wb") as f:
                    f.write(b"the user's own bytes")
            os.mkdir(f"{own}/d/sub")
            with open(f"{own}/mine", "wb") as f:
                f.write(b"mine")
            print(json.dumps({}))
            """,
            own=self.mounted("a"),
        )

    def mounted(self, which: str) -> str:
        """The current round's directory through mount ``which``."""
        return str((self.a if which == "a" else self.b).mnt / "u" / self.own.name)

    def cleanup(self) -> None:
        shutil.rmtree(self.outside, ignore_errors=True)


@pytest.fixture
def attack(shared_mounts: Any) -> Iterator[Attack]:
    a = Attack(shared_mounts)
    try:
        yield a
    finally:
        a.cleanup()


# The swap, done by the user right after the mount looked ``d`` up.
SWAPS = {
    # d becomes a symlink to the root-only tree (in the backing directly: a login node).
    "symlink": """
        os.rename(f"{bk}/d", f"{bk}/d.old")
        os.symlink(args["outside"] + "/dir", f"{bk}/d")
    """,
    # The same, done through the other mount (another node).
    "symlink-via-b": """
        os.rename(f"{mb}/d", f"{mb}/d.old")
        os.symlink(args["outside"] + "/dir", f"{mb}/d")
    """,
    # d becomes root's own directory inside the backing (renamed into place).
    "rootdir": """
        os.rename(f"{bk}/d", f"{bk}/d.old")
        os.rename(f"{bk}/rootdir", f"{bk}/d")
    """,
}


@pytest.mark.parametrize("by_fd", [True, False], ids=["held-fd", "path"])
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_directory_swapped_after_its_lookup_leads_nowhere(
    attack: Attack, swap: str, by_fd: bool
) -> None:
    attack.mount()
    for op, action in DIR_OPS.items():
        attack.reset_own()
        result = attack.run(
            """
            own, bk, mb = args["own"], args["bk"], args["mb"]
            by_fd = args["by_fd"]
            p = f"{own}/d"
            dfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
            os.stat(p)  # the kernel's entries for d and its names are fresh
            for name in ("victim", "secret", "sub"):
                os.lstat(f"{p}/{name}")
            at = (lambda name: name) if by_fd else (lambda name: f"{p}/{name}")
            """,
            SWAPS[swap],
            """
            if by_fd:
                os.fchdir(dfd)  # names below are relative to the held directory
            """,
            f"result = {action}\n",
            """
            print(json.dumps({"result": result, "read": read}))
            """,
            own=attack.mounted("a"),
            bk=str(attack.own),
            mb=attack.mounted("b"),
            outside=str(attack.outside),
            by_fd=by_fd,
        )
        attack.check(f"{op} ({swap}, {'fd' if by_fd else 'path'})", result)


@pytest.mark.parametrize("by_fd", [True, False], ids=["held-fd", "path"])
@pytest.mark.parametrize("kind", ["manifest", "plain"])
def test_a_file_swapped_for_a_symlink_after_its_lookup_leads_nowhere(
    attack: Attack, kind: str, by_fd: bool
) -> None:
    """The user's own file (written through the mount: a manifest; or put
    into the backing directly: a plain file) is looked up (and opened), then
    its name becomes a symlink to a root-only file."""
    attack.mount()
    for op, action in FILE_OPS.items():
        attack.reset_own()
        result = attack.run(
            """
            own, bk, kind = args["own"], args["bk"], args["kind"]
            by_fd = args["by_fd"]
            p = f"{own}/f"
            if kind == "manifest":
                with open(p, "wb") as f:
                    f.write(os.urandom(10000))
            else:
                with open(f"{bk}/f", "wb") as f:
                    f.write(os.urandom(10000))
            os.stat(p)
            fd = os.open(p, os.O_RDWR) if kind == "manifest" else os.open(p, os.O_RDONLY)
            os.rename(f"{bk}/f", f"{bk}/f.old")
            os.symlink(args["target"], f"{bk}/f")
            """,
            f"result = {action}\n",
            """
            print(json.dumps({"result": result, "read": read}))
            """,
            own=attack.mounted("a"),
            bk=str(attack.own),
            kind=kind,
            target=str(attack.outside / "dir" / "secret"),
            by_fd=by_fd,
        )
        attack.check(f"{op} ({kind}, {'fd' if by_fd else 'path'})", result)


def test_a_symlink_there_before_the_lookup_is_only_ever_the_users_own_walk(
    attack: Attack,
) -> None:
    """A name that is a symlink when the mount first looks at it is a
    symlink through the mount: the kernel follows it with the user's own
    rights (EACCES into a root-only tree), never the daemon."""
    attack.mount()
    for op, action in DIR_OPS.items():
        attack.reset_own()
        result = attack.run(
            """
            own, bk = args["own"], args["bk"]
            by_fd = False
            os.symlink(args["outside"] + "/dir", f"{bk}/e")
            os.symlink("../../" * 12 + args["outside"].lstrip("/") + "/dir", f"{bk}/rel")
            out = {}
            dfd = None
            for name in ("e", "rel"):
                p = f"{own}/{name}"
                at = lambda n: f"{p}/{n}"  # noqa: E731
            """,
            f"    out[name] = {action}\n",
            """
            print(json.dumps({"result": out, "read": read}))
            """,
            own=attack.mounted("a"),
            bk=str(attack.own),
            outside=str(attack.outside),
        )
        attack.check(f"{op} (symlink before lookup)", result)


def test_a_forged_manifest_never_serves_another_files_bytes(attack: Attack) -> None:
    """Root saves a private file; the user learns its id and version (as if
    leaked) and writes manifests of their own naming it, pending (this
    node holds it) and durable (naming its chunks), and one naming a chunk
    hash that is a path. None of them reads root's bytes: a manifest the
    daemons did not write is never acted on (served as the plain file it is)."""
    attack.mount()
    private = attack.a.mnt / "private"
    private.mkdir(mode=0o700)
    secret = os.urandom(300_000)
    attack.secrets.append(secret)
    (private / "salary.pt").write_bytes(secret)
    manifest = manifest_body(attack.backing / "private/salary.pt")
    attack.a.wait_durable()
    durable = manifest_body(attack.backing / "private/salary.pt")
    attack.reset_own()
    forgeries = {
        "pending": {**manifest, "mode": 0o644, "holders": [attack.a.stat()["node"]]},
        "durable": {**durable, "mode": 0o644},
        "path-hash": {**durable, "mode": 0o644, "chunks": [[0, 10, "../../../../etc/passwd"]]},
    }
    for body in forgeries.values():
        body.pop("mac", None)
    result = attack.run(
        """
        own, bk = args["own"], args["bk"]
        out = {}
        for name, body in args["forged"].items():
            with open(f"{bk}/{name}.pt", "wb") as f:
                f.write(b"CKPTFS-MANIFEST 1\\n" + json.dumps(body).encode() + b"\\n")
            out[name] = attempt(lambda: open(f"{own}/{name}.pt", "rb").read())
            with open(f"{bk}/sealed-{name}.pt", "wb") as f:
                # A seal copied from root's manifest does not fit the user's file.
                f.write(b"CKPTFS-MANIFEST 1\\n" + json.dumps({**body, "mac": args["mac"]}).encode()
                        + b"\\n")
            out["sealed-" + name] = attempt(lambda: open(f"{own}/sealed-{name}.pt", "rb").read())
        print(json.dumps({"result": out, "read": read}))
        """,
        own=attack.mounted("a"),
        bk=str(attack.own),
        forged=forgeries,
        mac=durable["mac"],
    )
    attack.check("forged manifests", result)
    assert set(result["result"].values()) == {"ok"}, result  # each read as the plain file it is
    reported = [line for line in attack.a.log().splitlines() if "served as the plain file" in line]
    assert len(reported) == 2 * len(forgeries), reported  # once each, naming it
    attack.a.allowed_log = ["served as the plain file it is"]
    # Through the other mount too (it never cached the file).
    assert (private / "salary.pt").read_bytes() == secret
    assert attack.a.cli("check", str(attack.backing), check=False).returncode == 1


@pytest.mark.parametrize(
    "squat",
    ["symlink-outside", "user-owned", "world-writable", "chunks-symlink"],
)
def test_a_ckptfs_directory_a_user_prepared_refuses_the_mount(
    shared_mounts: Any, squat: str
) -> None:
    """The user owns the backing directory (a per-user backing, as the Slurm
    prolog makes) and prepares ``.ckptfs`` before the mount: the mount
    refuses with one line naming it, and nothing outside changes."""
    m = shared_mounts("a")
    outside = Path(tempfile.mkdtemp(prefix="ckptfs-outside-", dir="/tmp"))
    try:
        outside.chmod(0o700)
        (outside / "etc").mkdir()
        before = snapshot(outside)
        os.chown(m.backing, USER, GROUP)
        ck = m.backing / ".ckptfs"
        if squat == "symlink-outside":
            ck.symlink_to(outside / "etc")
        elif squat == "user-owned":
            ck.mkdir()
            os.chown(ck, USER, GROUP)
        elif squat == "world-writable":
            ck.mkdir()
            ck.chmod(0o777)
        else:
            ck.mkdir(mode=0o700)
            (ck / "chunks").symlink_to(outside / "etc")
        proc = m.cli("mount", str(m.mnt), "--backing", str(m.backing), check=False)
        assert proc.returncode != 0 and not is_mounted(m.mnt)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and ".ckptfs" in lines[0], proc.stderr
        assert snapshot(outside) == before
        m.allowed_log = [".ckptfs"]
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_a_squatted_cache_directory_refuses_the_mount(shared_mounts: Any) -> None:
    """/dev/shm is everyone's: a cache directory a user made first (its
    journal is what recovery reads) refuses the mount."""
    m = shared_mounts("a")
    squatted = Path(tempfile.mkdtemp(prefix="ckptfs-squat-", dir="/dev/shm"))
    try:
        os.chown(squatted, USER, GROUP)
        proc = m.cli(
            "mount", str(m.mnt), "--backing", str(m.backing),
            env={"CKPTFS_CACHE_DIR": str(squatted)}, check=False,
        )  # fmt: skip
        assert proc.returncode != 0 and not is_mounted(m.mnt)
        assert str(squatted) in proc.stderr and "uid 65534" in proc.stderr, proc.stderr
    finally:
        shutil.rmtree(squatted, ignore_errors=True)
