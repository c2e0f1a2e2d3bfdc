"""Atomic files and directories: the one implementation for run directories, the orchestrator <->
trainer exchange, checkpoints and final models.

Standard library only, so the CLI and the launched backends share it (one of the contracts in
``skyrl_contracts``; how a run-directory file appears is part of that contract).

Files (``write_bytes`` / ``write_text`` / ``write_json``): written to a temporary file in the same
directory, flushed and fsynced, renamed over the real name with ``os.replace``, and the directory
fsynced. A reader sees the whole old content or the whole new one, and after a power cut the file
is one of the two. On any exception (a full disk, a failed rename) the temporary file is removed.
Only a process killed outright (SIGKILL, power cut) between creating and renaming it leaves its
``.tmp-*`` behind, never a half file under the real name; ``remove_leftovers`` deletes those.

Directories (``publish_dir`` / ``atomic_dir``): built at a temporary path next to the final one,
fsynced, then put in place; ``publish_dir`` says exactly what a reader can see.

Names next to a published path, for the start-up clean-up of a directory's one writer:
``.tmp-*`` is unfinished or already replaced (delete it), ``.trash-*`` was being deleted (delete
it), ``.old-<name>-<pid>`` is a complete published directory moved aside by ``publish_dir``'s
fallback path (put it back when ``<name>`` is missing, else delete it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
OLD_PREFIX = ".old-"

PathLike = str | os.PathLike


def _temp_path(path: Path) -> Path:
    # The pid says which process left it; the random part keeps concurrent writers apart.
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}")


def _fsync_dir(path: PathLike) -> None:
    """Make a directory's entries (a rename into it) durable, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; the rename itself still happened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; nothing more to do there
        pass
    finally:
        os.close(fd)


def write_bytes(path: PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    # os.open with 0o666, unlike tempfile.mkstemp (0o600), gives the umask's permissions, as a
    # plain write would: run directories may be read by other users on a shared file system.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    write_bytes(path, text.encode(encoding))


def write_json(path: PathLike, obj: Any, *, indent: int | None = 2) -> None:
    """``indent=None`` for machine-only files (batches, buffer state), where size matters."""
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def fsync_tree(root: PathLike) -> None:
    """fsync every file under ``root``, then every directory bottom-up (their entries)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            file = os.path.join(dirpath, name)
            if os.path.islink(file):
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


# ------------------------------------------------------------------------------ directories

_AT_FDCWD = -100  # linux/fcntl.h
_RENAME_EXCHANGE = 2  # linux/fs.h
# Where the kernel, the file system (NFS, older FUSE) or a seccomp filter has no exchange.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, or a libc without it
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def exchange(a: PathLike, b: PathLike) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``).

    False where the platform or the file system cannot (nothing was changed then); other errors
    (a missing path, another file system) raise ``OSError``."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True

    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _old_copies(final_dir: Path) -> list[Path]:
    prefix = f"{OLD_PREFIX}{final_dir.name}-"
    if not final_dir.parent.is_dir():
        return []
    return [p for p in final_dir.parent.iterdir() if p.name.startswith(prefix) and p.name[len(prefix) :].isdigit()]


def recover_dir(final_dir: PathLike) -> None:
    """Finish what a fallback ``publish_dir`` killed between its two renames left: the complete old
    directory at ``.old-<name>-<pid>`` goes back to ``final_dir`` when that is missing; any other
    ``.old-<name>-*`` is deleted."""
    final_dir = Path(final_dir)
    olds = _old_copies(final_dir)
    if olds and not os.path.lexists(final_dir):
        newest = max(olds, key=lambda p: p.stat().st_ctime_ns)  # a rename updates ctime
        os.replace(newest, final_dir)
        olds.remove(newest)
    for old in olds:
        _remove(old)


def remove_leftovers(directory: PathLike, prefixes: tuple[str, ...] = (TMP_PREFIX, TRASH_PREFIX)) -> None:
    """Start-up clean-up by the one writer of ``directory``, after a killed run: entries named with
    ``prefixes`` are deleted, ``.old-*`` directories are put back or deleted (``recover_dir``).

    Never while another process writes there: its temporary files would go too."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for child in list(directory.iterdir()):
        if child.name.startswith(OLD_PREFIX):
            name = child.name[len(OLD_PREFIX) :].rpartition("-")[0]
            if name:
                recover_dir(directory / name)
        elif child.name.startswith(prefixes):
            _remove(child)


def publish_dir(tmp_dir: PathLike, final_dir: PathLike, *, fsync: bool = True) -> None:
    """Put the directory built at ``tmp_dir`` in place as ``final_dir`` (same parent directory).

    A reader sees the whole old directory or the whole new one under ``final_dir``, never a
    half-written one. On Linux with a file system that has it (ext4, xfs, btrfs, tmpfs, overlayfs) an
    existing ``final_dir`` is never missing, not even for an instant: the two paths are swapped in
    one ``renameat2(RENAME_EXCHANGE)`` and the old content, now at ``tmp_dir``, is deleted (a crash
    before that leaves a ``.tmp-*``, which start-up clean-up deletes).

    POSIX has no call that replaces a non-empty directory in one step, so elsewhere (macOS, NFS,
    file systems that refuse the exchange) the old directory is renamed to ``.old-<name>-<pid>`` and
    the new one renamed in: between those two renames (microseconds) ``final_dir`` is missing, and
    a reader that looks just then finds nothing (here none does: weights are found through
    ``weights/LATEST``, checkpoints and ``final/`` are read once their writer has finished). A crash
    inside that window leaves the complete old directory at ``.old-<name>-<pid>``, which the next
    ``publish_dir`` of that name, ``recover_dir`` or ``remove_leftovers`` puts back.

    A reader that opens files one by one while the swap happens may get some from each version;
    readers that must not, pick a name that is never replaced while they read (``weights/LATEST``
    names a new ``v<k>``). ``fsync`` (default): every file and directory under ``tmp_dir`` is on
    disk before it becomes visible (a checkpoint's weights before its name). One writer per
    ``final_dir``: concurrent publishers of the same name are not supported.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    recover_dir(final_dir)
    if fsync:
        fsync_tree(tmp_dir)
    if not os.path.lexists(final_dir):
        os.replace(tmp_dir, final_dir)
    elif exchange(tmp_dir, final_dir):
        shutil.rmtree(tmp_dir, ignore_errors=True)
    else:
        old = final_dir.with_name(f"{OLD_PREFIX}{final_dir.name}-{os.getpid()}")
        os.replace(final_dir, old)
        try:
            os.replace(tmp_dir, final_dir)
        except BaseException:
            os.replace(old, final_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final_dir.parent)


@contextlib.contextmanager
def atomic_dir(target: PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target``; ``publish_dir`` it there on success.

    On an exception the temporary directory is removed and ``target`` is untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(target)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, target, fsync=fsync)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def discard_dir(path: PathLike) -> None:
    """Delete a published directory without a half-deleted one ever under its name: it is renamed
    to ``.trash-<name>`` first (left over by a crash, start-up clean-up deletes it)."""
    path = Path(path)
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
