"""The ground floor: files written so that a kill or a full disk never leaves half of them, and what a failed
write says. Imports nothing from trl_flow, so every floor above (models/, the engine, hub) may use it.

- :func:`write_atomically` puts a folder in place whole (checkpoints, the final model);
- :class:`SaveError`, :func:`describe_write_error`, :func:`disk_note`, :func:`is_disk_full`: failed writes;
- :func:`follow_umask` (safetensors writes 0600), :func:`sha256`, :func:`write_json`, :func:`read_json`;
- the file names every floor agrees on (:data:`LORA_WEIGHT_NAME`, the temporary names of a save).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
#: Where save_model writes before putting the files in place (inside an existing target folder), and the suffix of
#: the temporary sibling folder of a target that does not exist yet.
SAVE_TMP_NAME = ".trl_flow_save.tmp"
SAVE_TMP_SUFFIX = ".trl_flow_save.tmp"


# ------------------------------------------------------------------------------------------------ write errors
class SaveError(RuntimeError):
    """Writing a checkpoint or the final model failed (disk full, permissions, ...): the message says which folder,
    on which disk, and what is intact."""


def disk_note(path: str) -> str:
    """``the disk mounted at /mnt (123 MiB free)`` for the disk holding ``path`` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    mount = probe
    while not os.path.ismount(mount) and os.path.dirname(mount) != mount:
        mount = os.path.dirname(mount)
    try:
        free = f"{shutil.disk_usage(probe).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"the disk mounted at {mount} ({free})"


def is_disk_full(error: BaseException) -> bool:
    """An ``OSError`` ENOSPC / EDQUOT, or what torch's zip writer and safetensors say when a write comes up short."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e or "")
        if any(s in text for s in ("No space left", "unexpected pos", "file write failed", "Disk quota")):
            return True
    return False


def describe_write_error(folder: str, error: BaseException) -> str:
    """``the disk mounted at / (12 MiB free) is full`` or ``<disk>: OSError: ...`` for a failed write into
    ``folder``."""
    where = disk_note(folder)
    if is_disk_full(error):
        return f"{where} is full ({type(error).__name__}: {str(error).strip().splitlines()[0][:200]})"
    return f"{type(error).__name__}: {str(error).strip()[:300]} ({where})"


def _fsync_tree(folder: str) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb+") as f:
                os.fsync(f.fileno())


def write_atomically(target: str, write, last: tuple[str, ...] = ("model_index.json",)) -> None:
    """``write(folder)`` into a temporary folder, then put the result at ``target`` so that a kill or a failed
    write never leaves part of it there.

    - ``target`` missing or empty: the temporary folder is its sibling (same disk), renamed to ``target`` at the end.
    - ``target`` an existing folder (e.g. the run's output_dir): the files are written into
      ``target/.trl_flow_save.tmp`` and moved into place by ``os.replace``, one name at a time (a file replaces the
      old one atomically; a folder replaces the old one by two renames); a name in ``last`` (a pipeline's
      ``model_index.json``) is removed first and put in place last, so a half-replaced pipeline never loads.

    A failure (or a KeyboardInterrupt) while writing removes the temporary folder and re-raises; ``target`` is then
    as it was."""
    target = os.path.abspath(target)
    if not os.path.isdir(target) or not os.listdir(target):
        tmp = os.path.join(os.path.dirname(target), "." + os.path.basename(target) + SAVE_TMP_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            write(tmp)
            _fsync_tree(tmp)
            os.replace(tmp, target)  # an empty folder is replaced too
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return
    tmp = os.path.join(target, SAVE_TMP_NAME)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write(tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    names = sorted(os.listdir(tmp), key=lambda n: n in last)
    for name in last:
        if name in names and os.path.isfile(os.path.join(target, name)):
            os.remove(os.path.join(target, name))
    old = os.path.join(tmp, ".old")
    for name in names:
        src, dst = os.path.join(tmp, name), os.path.join(target, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            os.makedirs(old, exist_ok=True)
            os.replace(dst, os.path.join(old, name))
        os.replace(src, dst)
    shutil.rmtree(tmp, ignore_errors=True)


def follow_umask(path: str) -> None:
    """Give ``path`` the mode a file the user creates gets (0666 minus the umask). safetensors writes its files
    0600, unlike every other file of a checkpoint or a saved model."""
    if os.path.isfile(path):
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(path, 0o666 & ~mask)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint file {path} cannot be read: {e}") from None
