"""Build-once directories in the user cache, safe against concurrent builders.

Model directories for tests and the demo are expensive enough (a download, a dequantization) that they
are built once per machine and reused. Several processes may ask for the same directory at the same
time (pytest workers, a server started by a test), so a build holds an exclusive file lock, builds into
a temporary sibling directory and renames it into place: a reader sees either no directory or a
complete one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

try:  # fcntl is POSIX-only; without it builds still work, just without cross-process exclusion
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("radixserve.testing")

CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"

# Written last into a build directory, before the rename; a directory without it is not trusted.
COMPLETE_MARKER = ".radixserve-complete"


def cache_root() -> Path:
    """The root of radixserve's cache: $RADIXSERVE_CACHE_DIR, else the platform's user cache dir."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("radixserve"))


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as lock_file:
        if fcntl is not None:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def build_cached_dir(name: str, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """Return `root/name`, calling `build(tmp_dir)` first if it does not exist yet.

    `build` fills an empty directory; on success that directory is atomically renamed to `root/name`.
    On failure the temporary directory is removed and the exception propagates, so the next call
    tries again. Concurrent callers (threads or processes) wait on a lock and reuse the result.
    """
    root = Path(root) if root is not None else cache_root()
    final_dir = root / name
    if is_complete(final_dir):  # fast path: no lock needed to read a finished directory
        return final_dir

    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{name}.lock"):
        if is_complete(final_dir):  # another process finished it while we waited
            return final_dir
        if final_dir.exists():
            # Left behind by something that did not go through this function (or a marker lost by
            # hand); it cannot be trusted, and the rename below needs the name free.
            logger.warning("removing incomplete cache directory %s", final_dir)
            shutil.rmtree(final_dir)
        if fcntl is not None:
            # Holding the lock, we are the only live builder of `name`: any temporary directory of
            # the same name belongs to a builder that was killed mid-way.
            for stale in root.glob(f"{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=root))
        try:
            build(tmp_dir)
            (tmp_dir / COMPLETE_MARKER).write_text("ok\n")
            os.rename(tmp_dir, final_dir)
        except OSError:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            # Without fcntl two builders can race to the rename; the loser's work is redundant.
            if is_complete(final_dir):
                return final_dir
            raise
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return final_dir
