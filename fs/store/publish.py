"""Publishing a file's manifest at its name, each in one store call: a new
file's first manifest, a replace that checks what is at the name first
(still this file, still the version expected, or still the plain file a
writer adopted), and a takeover's fenced publish, which never lands over a
newer version. Published says what became of an attempt."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from enum import Enum

from ckptfs.fs.store.beneath import check_rel, in_parent, open_dir, parent_dir
from ckptfs.fs.store.blocking import Call
from ckptfs.fs.store.entries import Entry, PlainFile, read_entry_in
from ckptfs.fs.store.manifest import (
    DirTimes,
    Manifest,
    ManifestError,
    dir_times_kept,
    fsync_dir,
    is_file_id,
    manifest_from_fd,
    read_manifest,
    tmp_name,
    write_all,
    write_manifest,
)

log = logging.getLogger("ckptfs.publish")


class Published(Enum):
    """What became of an attempt to write a file's manifest."""

    DONE = "done"
    STALE = "stale"  # what would have been written is out of date: nothing written
    NAME_GONE = "name gone"  # the path no longer names this file


def create_manifest(
    call: Call[tuple[Entry, int]],
    root: int,
    rel: str,
    manifest: Manifest,
    uid: int,
    gid: int,
    expect_parent: int | None,
    key: bytes | None,
) -> tuple[Entry, int]:
    """Write a new file's first manifest, owned by ``uid`` and the right group:
    the parent's under a setgid directory, else ``gid``. Returns (entry, gid)."""
    with in_parent(root, rel, expect_parent) as (dfd, name):
        parent = os.fstat(dfd)
        if parent.st_mode & stat.S_ISGID:
            gid = parent.st_gid
        write_manifest(
            name, manifest, dir_fd=dfd, owner=(uid, gid), abandoned=call.abandoned, key=key
        )
        start = time.monotonic()
        entry = read_entry_in(dfd, name, rel, key)
        entry.read_at = start
        return entry, gid


def replace_manifest(
    call: Call[Published],
    root: int,
    fence_dir: Callable[[], int],
    rel: str,
    manifest: Manifest,
    owner: tuple[int, int],
    file_id: str,
    expect_version: str | None,
    plain: PlainFile | None,
    before: Callable[[], None] | None,
    key: bytes | None,
) -> Published:
    """Replace the manifest at ``rel`` if it still belongs to ``file_id`` (and,
    with ``expect_version``, is still that version), or, with ``plain``, if
    that plain file is still there; ``before`` runs first, once.

    A new version (no ``expect_version``) never lands over a newer version
    of the same file (Manifest.order): another node rewrote it in place and
    closed after this one began its commit. STALE says so, and this version
    is superseded, as if the other close had come later."""
    before = _once(before)
    if expect_version is not None:
        for _ in range(APPEND_TRIES):
            appended = _append_to_current(
                call, root, rel, manifest, owner, file_id, expect_version, before, key
            )
            if appended is not _Appended.REPLACED:
                break
        if isinstance(appended, Published):
            return appended
    try:
        try:
            current, st = _manifest_and_stat(root, rel, key)
        except FileNotFoundError:
            # A takeover may have moved it aside for an instant (see
            # takeover_manifest): wait for it before calling the name gone,
            # and never call it gone while the takeover still holds it.
            if not _wait_for_fence(fence_dir(), file_id):
                raise
            try:
                current, st = _manifest_and_stat(root, rel, key)
            except FileNotFoundError:
                raise OSError(
                    errno.EBUSY, f"{rel}: a takeover of this file holds its name; try again"
                ) from None
    except FileNotFoundError:
        # No takeover holds the name: one that failed (or died) may have
        # left the manifest aside.
        if not _restore_aside(root, rel, file_id):
            return Published.NAME_GONE
        try:
            current, st = _manifest_and_stat(root, rel, key)
        except FileNotFoundError:
            return Published.NAME_GONE
    if current is None and (plain is None or not plain.matches(st)):
        return Published.NAME_GONE  # a plain file was put at the path (another one)
    if current is not None and current.file_id != file_id:
        return Published.NAME_GONE
    if expect_version is None and current is not None and current.order > manifest.order:
        return Published.STALE
    if expect_version is not None and (
        current is None or not _ours_or_older(current, expect_version, manifest.order)
    ):
        return Published.STALE
    if before is not None:
        before()
    write_manifest(
        rel,
        manifest,
        dir_fd=root,
        owner=owner,
        abandoned=call.abandoned,
        keep_dir_times=True,
        key=key,
    )
    return Published.DONE


# Appends tried in a row while the manifest file is replaced under each
# (each replace is another node's publish: more in a row are unlikely).
APPEND_TRIES = 3


class _Appended(Enum):
    REPLACED = "replaced"  # the file appended to no longer has a name


def _append_to_current(
    call: Call[Published],
    root: int,
    rel: str,
    manifest: Manifest,
    owner: tuple[int, int],
    file_id: str,
    expect_version: str,
    before: Callable[[], None] | None,
    key: bytes | None,
) -> Published | _Appended | None:
    """A flush's manifest appended as a record to the manifest file at
    ``rel``, if that file holds exactly ``expect_version`` of ``file_id``;
    None if it does not (or cannot be opened), or if the file's owner or
    mode changed since, for the check-then-rename path to decide; REPLACED
    if the file appended to lost its name meanwhile.

    Why an append: the flush happens after the close returned, so it must
    never change which file the name shows. A check of the name followed by
    a rename over it is not atomic across nodes: another node's rename onto
    the name in between (or for as long as this node is stopped between the
    two) would be undone, its newer file replaced by this older one. The
    check and the append here go through one descriptor, so they are of one
    file: renamed meanwhile, the record goes with it; replaced or removed,
    it lands on a file no name shows. Then what the name shows now decides:
    it may be this very version again (its metadata rewritten, a buddy's
    takeover), an older one that landed over it, a newer one, or another
    file. Calling it gone at once would drop a version that still owes its
    flush (bug 9 of docs/FAULT-TRIALS.md): REPLACED says so, and the
    caller tries again (APPEND_TRIES) before it looks at the name."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        with parent_dir(root, rel) as (dfd, name):
            fd = os.open(name, flags, dir_fd=dfd)
    except OSError:
        return None  # gone, a symlink, a directory: the other path decides
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if (st.st_uid, st.st_gid) != owner or stat.S_IMODE(st.st_mode) != manifest.mode & 0o7777:
            # A chown or chmod since the pending publish: the manifest file's
            # owner and bits are the file's (docs/FORMAT.md), and only a new
            # manifest file gets them safely (an owner changed in place would
            # unseal the records before it).
            return None
        try:
            current = manifest_from_fd(fd, rel, key, st)
        except ManifestError:
            return None
        if (
            current is None
            or not current.sealed
            or current.file_id != file_id
            or current.version != expect_version
        ):
            return None
        if before is not None:
            before()
        if call.abandoned():  # the loop gave up on this call: a newer one may follow
            return Published.STALE
        write_all(fd, manifest.record(key, (st.st_uid, st.st_gid)))
        os.fsync(fd)
        if os.fstat(fd).st_nlink == 0:
            return _Appended.REPLACED  # replaced or removed since it was opened
        return Published.DONE
    except OSError as exc:
        if exc.errno == errno.ESTALE:  # NFS: removed by another client meanwhile
            return _Appended.REPLACED
        raise
    finally:
        os.close(fd)


def _once(hook: Callable[[], None] | None) -> Callable[[], None] | None:
    """``hook``, run by its first call only (a publish may check twice)."""
    if hook is None:
        return None
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            hook()

    return run


def _ours_or_older(current: Manifest, version: str, order: tuple[int, str]) -> bool:
    """Whether a rewrite of ``version`` (at ``order``, Manifest.order: made
    durable, new metadata) may replace ``current``, the same file's manifest
    at its name: ``current`` is that version, or an older one that landed
    over it.

    Why the second: a node's check of the version and its rename are one
    store call but not atomic across nodes. Node A's durable V, checked
    just before node B published its newer V' (B's close returned), lands
    over V'; B's flush then finds V at the name. V' is the newer content, so
    B publishes it again; dropping it as "rewritten elsewhere" would lose a
    closed file. A version of unknown order (seq 0: an older manifest) or a
    newer one (another close after ours) stays."""
    if current.version == version:
        return True
    return 0 < current.seq and current.order < order


def _manifest_and_stat(
    root: int, rel: str, key: bytes | None
) -> tuple[Manifest | None, os.stat_result]:
    """The manifest at ``rel`` and the stat of that file. None for a plain
    file, and for an unreadable or unsealed manifest: neither is ours to
    replace, unless it is the very plain file a writer adopted."""
    with parent_dir(root, rel) as (dfd, name):
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            # A symlink at the name: another file there, not ours to replace.
            return None, os.stat(name, dir_fd=dfd, follow_symlinks=False)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, st
        try:
            m = manifest_from_fd(fd, rel, key, st)
            return (m if m is not None and m.sealed else None), st
        except ManifestError:
            return None, st
    finally:
        os.close(fd)


# Seconds after which a fence left by a dead takeover is broken: longer than a
# backing-store call may take (backing_timeout, 120 s by default), so a live
# takeover whose call the loop gave up on is never overtaken.
FENCE_STALE = 300.0
FENCE_WAIT = 5.0  # longest a publish waits for a takeover's fence to go


def _fence(file_id: str) -> str:
    """The fence's name in ``.ckptfs/fence``: the file id, which a manifest
    (user input) gave, so only if it is a plain name."""
    if not is_file_id(file_id):
        raise OSError(errno.EINVAL, f"not a file id: {file_id!r}")
    return file_id


def _wait_for_fence(fence_fd: int, file_id: str) -> bool:
    """True if a takeover of ``file_id`` was fenced (and has ended, or waited long enough)."""
    try:
        os.stat(_fence(file_id), dir_fd=fence_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    deadline = time.monotonic() + FENCE_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.005)
        try:
            os.stat(_fence(file_id), dir_fd=fence_fd, follow_symlinks=False)
        except FileNotFoundError:
            break
    return True


def _take_fence(fence_fd: int, file_id: str, holder: str = "", rel: str = "") -> bool:
    """The fence of ``file_id``, naming the node that holds it and the path
    it publishes at: a node restarted after it died holding one puts back
    what it had moved aside (restore_own_fences)."""
    name = _fence(file_id)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(2):
        try:
            fd = os.open(name, flags, 0o600, dir_fd=fence_fd)
            try:
                write_all(fd, json.dumps({"node": holder, "path": rel}).encode())
            finally:
                os.close(fd)
            return True
        except FileExistsError:
            try:
                age = time.time() - os.stat(name, dir_fd=fence_fd, follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if age < FENCE_STALE:
                return False
            os.unlink(name, dir_fd=fence_fd)  # left by a takeover that died
    return False


def takeover_manifest(
    call: Call[Published],
    root: int,
    fence_fd: int,
    rel: str,
    manifest: Manifest,
    file_id: str,
    expect_version: str,
    key: bytes | None = None,
    holder: str = "",
) -> Published:
    """Publish ``manifest`` at ``rel`` only over exactly ``expect_version``.

    The fenced publish of a takeover (docs/STATES.md, "Takeover and
    fencing"): the manifest there is moved aside atomically (rename), checked,
    and the new one linked into place with link(2), which fails if anything
    was published at the name meanwhile. So whatever another node (the
    writer, if it only seemed dead) publishes concurrently wins, and a
    takeover never puts its version over a newer one. A publish that finds
    the name missing in that instant waits for the fence (replace_manifest).
    """
    if not _take_fence(fence_fd, file_id, holder, rel):
        # Not STALE: the flusher would take that as "rewritten elsewhere" and
        # drop the only copy. An error makes it try again later.
        raise OSError(errno.EBUSY, f"{rel}: another takeover of this file is under way")
    try:
        parent, name = os.path.split(rel)
        try:
            dfd = open_dir(root, parent)
        except (FileNotFoundError, NotADirectoryError):
            # Its directory was removed (a job's rotation, rmtree, on another
            # node), or a file put in its place: so was the name. Had this
            # raised, the flusher would have retried for ever, after the first
            # time against its own fence.
            return Published.NAME_GONE
        try:
            # It rewrites the name's manifest as a flush does: the
            # directory's times stay (DirTimes).
            with dir_times_kept(dfd) as times:
                return _link_over(call, dfd, name, manifest, file_id, expect_version, times, key)
        finally:
            os.close(dfd)
    finally:
        try:
            os.unlink(_fence(file_id), dir_fd=fence_fd)
        except FileNotFoundError:
            pass


def _aside_name(name: str, file_id: str) -> str:
    """Where a takeover moves the manifest at ``name`` to check it: named
    by the file id (which the fence makes one takeover's at a time), so
    that a manifest left there by a takeover that failed or died is found
    again (_restore_aside); a temporary name to listings."""
    return f".{name[:128]}.ckptfs-tmp.aside-{_fence(file_id)}"


def _exists(dfd: int, name: str) -> bool:
    """Whether a regular file is at ``name`` (what a user put there, a
    directory or a symlink, is no manifest moved aside)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode)


def _restore_aside(root: int, rel: str, file_id: str) -> bool:
    """``_put_aside_back`` in ``rel``'s directory; False if there is none."""
    parent, name = os.path.split(rel)
    try:
        dfd = open_dir(root, parent)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        return _put_aside_back(dfd, name, file_id)
    finally:
        os.close(dfd)


def _put_aside_back(dfd: int, name: str, file_id: str, times: DirTimes | None = None) -> bool:
    """Put back at ``name`` the manifest a takeover of ``file_id`` left
    aside, if there is one and nothing is at ``name`` (else the aside name
    goes: the name holds something newer). For a caller that holds the
    file's fence, or found none. Whether there was one; an error putting it
    back raises, and it stays aside."""
    aside = _aside_name(name, file_id)
    if not _exists(dfd, aside):
        return False
    with times.change() if times is not None else contextlib.nullcontext():
        try:
            os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            log.warning("the manifest of %s, left aside by a takeover, is put back", name)
        except FileExistsError:
            pass
        fsync_dir(dfd)
        os.unlink(aside, dir_fd=dfd)
    return True


def restore_own_fences(root: int, fence_fd: int, node: str) -> list[str]:
    """At a daemon's start: the fences its node held when it died (a
    takeover has no journal: none of them is under way), each removed once
    what its takeover moved aside is back at its name. The paths put back."""
    restored = []
    for name in os.listdir(fence_fd):
        if not is_file_id(name):
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fence_fd)
            try:
                held = json.loads(os.read(fd, 8192) or b"{}")
            finally:
                os.close(fd)
            if not isinstance(held, dict) or held.get("node") != node or not node:
                continue
            rel = check_rel(str(held.get("path", "")))
        except (OSError, ValueError):
            continue  # not ours, or not a fence this code wrote: it goes stale
        if _restore_aside(root, rel, name):
            restored.append(rel)
        try:
            os.unlink(name, dir_fd=fence_fd)
        except FileNotFoundError:
            pass
    return restored


def restore_aside(root: int, fence_fd: int, rel: str, file_id: str) -> bool:
    """``_restore_aside`` unless a takeover of ``file_id`` is under way (its
    fence is there and not stale): its manifest aside is not left over;
    EBUSY then if it has one aside."""
    try:
        age = time.time() - os.stat(_fence(file_id), dir_fd=fence_fd).st_mtime
    except FileNotFoundError:
        age = FENCE_STALE
    if age >= FENCE_STALE:
        return _restore_aside(root, rel, file_id)
    try:
        with parent_dir(root, rel) as (dfd, name):
            held = _exists(dfd, _aside_name(name, file_id))
    except (FileNotFoundError, NotADirectoryError):
        held = False
    if held:
        # Its takeover is under way, or died and its node has not come back:
        # the manifest is neither here nor gone.
        raise OSError(errno.EBUSY, f"{rel}: a takeover holds its manifest aside")
    return False


def _put_back(dfd: int, aside: str, name: str, times: DirTimes) -> bool:
    """Link the manifest moved to ``aside`` back at ``name``; whether the
    name now holds something (it, or a newer one published meanwhile)."""
    try:
        with times.change():
            os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError:
        pass  # something newer was published meanwhile: it stays
    except OSError:
        return False  # left at ``aside``; the caller's error says why
    return True


def _link_over(
    call: Call[Published],
    dfd: int,
    name: str,
    manifest: Manifest,
    file_id: str,
    expect_version: str,
    times: DirTimes,
    key: bytes | None = None,
) -> Published:
    """The fenced publish itself, in the directory ``dfd`` (see
    takeover_manifest), each change of the directory's names counted in
    ``times``."""
    aside = _aside_name(name, file_id)
    new = tmp_name(name)
    try:
        # The new manifest is written first, so the name is missing only for
        # a rename, a read and a link. One an earlier try could not put back
        # (we hold the fence: no takeover has it aside now) goes back first.
        _put_aside_back(dfd, name, file_id, times)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return Published.NAME_GONE
        # In the directory held open: by path, a directory removed and made
        # again since would get the temporary name, and keep it.
        write_manifest(
            new, manifest, dir_fd=dfd, owner=(st.st_uid, st.st_gid), dir_times=times, key=key
        )
        try:
            with times.change():
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            # An NFS rename retransmitted after it was done answers ENOENT,
            # or an error after it was done: whether it was is at ``aside``.
            if _exists(dfd, aside):
                pass
            elif isinstance(exc, FileNotFoundError):
                return Published.NAME_GONE
            else:
                raise
        # Whether the name holds what is to stay there (ours, what was there,
        # or something newer): until it does, the only copy of the manifest
        # that was there is at ``aside``.
        placed = False
        try:
            try:
                current = read_manifest(aside, dir_fd=dfd, key=key)
            except ManifestError:
                current = None
            if current is not None and not current.sealed:
                current = None  # not a manifest ckptfs wrote: not the version taken over
            if (
                current is None
                or current.file_id != file_id
                or current.version != expect_version
                or current.state != "pending"
            ):
                # Not exactly the pending version taken over (its writer,
                # who only seemed dead, made it durable or replaced it):
                # what is there stays.
                placed = _put_back(dfd, aside, name, times)
                fsync_dir(dfd)
                if not placed:
                    raise OSError(errno.EIO, f"{name}: cannot put its manifest back")
                if current is None or current.file_id != file_id:
                    return Published.NAME_GONE
                return Published.STALE
            if call.abandoned():
                placed = _put_back(dfd, aside, name, times)
                fsync_dir(dfd)
                return Published.STALE
            try:
                with times.change():
                    os.link(new, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                placed = True
            except FileExistsError:
                placed = True
                return Published.STALE  # newer than what we took over: it stays
            finally:
                fsync_dir(dfd)
            return Published.DONE
        finally:
            # An error between the move aside and the link (EIO reading the
            # manifest back, a store failing) must not take the manifest with
            # the aside name: put it back first (fault trials, restart_store_eio).
            if not placed:
                placed = _put_back(dfd, aside, name, times)
            if placed:
                try:
                    with times.change():
                        os.unlink(aside, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # a name left over; the next try removes it
                    log.warning("%s not removed: %s", aside, exc)
            else:
                log.error("the manifest of %s is left at %s: it could not be put back; the "
                          "next publish of it puts it back", name, aside)  # fmt: skip
    finally:
        try:
            with times.change():
                os.unlink(new, dir_fd=dfd)
        except FileNotFoundError:
            pass
