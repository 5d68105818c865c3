"""Weights downloads that resume across process starts.

``huggingface_hub`` (2.x) resumes a broken transfer only within the call that started it (``http_get``
retries with a ``Range`` request); it downloads into a temporary file named for that one call and
deletes it when the call fails, so the next start downloads the whole file again. For the large files
(safetensors and GGUF weights) pagellm therefore fetches the blob itself, with the hub's own
primitives (the file's metadata, ``http_get`` with ``resume_size``, the cache's lock per blob), into
``blobs/<etag>.incomplete`` of the hub's cache (where older ``huggingface_hub`` releases kept partial
files), and renames it to ``blobs/<etag>`` once whole; ``snapshot_download`` then finds the blob and
only links it into the snapshot. What arrived before an interruption stays in that file and the next
start asks for the rest. A file in the snapshot is therefore always whole.

Files stored with Xet, where ``hf_xet`` is installed, are left to ``huggingface_hub``: ``hf_xet``
keeps the chunks it fetched in its own cache, and a later start fetches only the missing ones.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

WEIGHTS = ("*.safetensors", "*.gguf")  # the files worth resuming: everything else is small


class DownloadInterrupted(Exception):
    """A weights file's transfer broke off; what arrived is kept for the next start."""

    def __init__(self, filename: str, kept: int, size: int | None, partial: Path, cause: BaseException) -> None:
        self.filename, self.kept, self.size, self.partial, self.cause = filename, kept, size, partial, cause
        total = f" of {size}" if size is not None else ""
        super().__init__(f"the download of {filename} broke off after {kept}{total} bytes "
                         f"({type(cause).__name__}: {cause})")


def fetch_weights(repo_id: str, commit: str, files: list[str], patterns: list[str] | None, cache_dir: str,
                  endpoint: str, token: str | None) -> None:
    """Download the weights files among ``files`` that ``patterns`` select (None: all) at ``commit``
    into the cache's blobs, resuming any partial file an earlier start left."""
    for name in sorted(files):
        if not any(fnmatch.fnmatch(name, p) for p in WEIGHTS):
            continue
        if patterns is not None and not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        _fetch_blob(repo_id, commit, name, Path(cache_dir), endpoint, token)


def _fetch_blob(repo_id: str, commit: str, filename: str, cache_dir: Path, endpoint: str, token: str | None) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, is_xet_available, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo_id, filename, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    if not meta.etag or (meta.xet_file_data is not None and is_xet_available()):
        return  # (no blob name to resume under, or hf_xet's own chunk cache resumes it)
    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    blob = cache_dir / folder / "blobs" / meta.etag
    if blob.exists():
        return
    partial = blob.with_name(meta.etag + ".incomplete")
    lock = cache_dir / ".locks" / folder / f"{meta.etag}.lock"
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(str(lock)):
        if blob.exists():  # (another process finished it meanwhile)
            return
        done = partial.stat().st_size if partial.exists() else 0
        if meta.size is not None and done > meta.size:  # (not a prefix of this file)
            partial.unlink()
            done = 0
        if done:
            logger.info("%s: resuming %s after the %d bytes an earlier start downloaded", repo_id, filename, done)
        try:
            with open(partial, "ab") as f:
                http_get(meta.location, f, resume_size=done, headers=build_hf_headers(token=token),
                         expected_size=meta.size, displayed_filename=filename)
        except OSError as e:
            if e.errno == errno.ENOSPC:  # (a full disk: give the space back rather than keep a part)
                with contextlib.suppress(OSError):
                    partial.unlink()
                raise
            raise DownloadInterrupted(filename, _size(partial), meta.size, partial, e) from e
        except Exception as e:  # the HTTP client's connection errors, the hub's 5xx
            raise DownloadInterrupted(filename, _size(partial), meta.size, partial, e) from e
        os.chmod(partial, 0o644)
        os.replace(partial, blob)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
