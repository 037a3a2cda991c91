"""Remote GGUF files, read with HTTP range requests into a sparse local mirror.

    hf://OWNER/REPO[@REVISION]/PATH.gguf    a file on the Hugging Face Hub (the token and endpoint
                                            come from the usual huggingface_hub settings)
    https://HOST/PATH.gguf                  any server that honours ``Range`` requests

``RemoteGGUF(ref)`` mirrors the file (and, for the first shard of a split set, its sibling shards)
as sparse files of the remote size under ``$ZOO_REMOTE_CACHE`` (default ``~/.cache/zoo/remote``):
only the headers are fetched when it opens, then ``ensure(path, start, stop)`` fetches the byte
ranges a reader is about to touch. ``GGUFSource`` uses it for every read, so ``zoo plan`` reads a
header only and ``zoo audit`` the header plus the chosen experts/rows, never the whole file.

Which ranges are present is recorded beside each mirror (``NAME.ranges.json``, written after the
bytes), with the remote size and ETag: a file that changed remotely is fetched afresh, and an
interrupted fetch never leaves a range marked present that is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from zoo.sources.base import SourceError
from zoo.sources.gguf_header import SPLIT_NAME, check_header

HEADER_FIRST = 1 << 16           # first header fetch; grows 4x until the whole header is in
HEADER_MAX = 512 << 20           # a header that does not parse within this many bytes is corrupt
MAX_REQUEST = 64 << 20           # bytes per range request
_HF_REF = re.compile(r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?/(?P<path>.+)$")


def is_remote(ref) -> bool:
    return isinstance(ref, str) and (ref.startswith("hf://") or ref.startswith(("http://", "https://")))


def _cache_root() -> Path:
    return Path(os.environ.get("ZOO_REMOTE_CACHE", Path.home() / ".cache" / "zoo" / "remote")).expanduser()


def _resolve(ref: str) -> tuple[str, dict]:
    """(URL, request headers) of a remote reference."""
    m = _HF_REF.match(ref)
    if m is not None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        return hf_hub_url(m["repo"], m["path"], revision=m["rev"]), build_hf_headers()
    if ref.startswith("hf://"):
        raise SourceError(f"{ref}: expected hf://OWNER/REPO[@REVISION]/PATH.gguf")
    return ref, {}


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


class RemoteFile:
    """One remote file and its sparse mirror (see the module docstring)."""

    def __init__(self, ref: str, mirror: Path, session=None):
        from huggingface_hub.utils import get_session

        self.ref, self.path = ref, mirror
        self.url, self._headers = _resolve(ref)
        self._session = session or get_session()
        self.fetched_bytes = 0
        self.size, etag = self._probe()
        self._sidecar = mirror.with_name(mirror.name + ".ranges.json")
        state = self._load_state()
        if state.get("size") != self.size or state.get("etag") != etag:
            state = {"size": self.size, "etag": etag, "ranges": []}      # new, or changed remotely
            mirror.parent.mkdir(parents=True, exist_ok=True)
            with open(mirror, "wb") as f:
                f.truncate(self.size)                                    # sparse: no disk used yet
            self._save_state(state)
        self._state = state

    def _get(self, start: int, stop: int):
        headers = {**self._headers, "Range": f"bytes={start}-{stop - 1}"}
        try:
            r = self._session.get(self.url, headers=headers, follow_redirects=True, timeout=60)
        except Exception as e:          # connection errors of any HTTP stack
            raise SourceError(f"{self.ref}: cannot read bytes {start}-{stop - 1} ({type(e).__name__}: {e})") from None
        if r.status_code == 404:
            raise SourceError(f"{self.ref}: no such remote file (HTTP 404)")
        if r.status_code in (401, 403):
            raise SourceError(f"{self.ref}: access denied (HTTP {r.status_code}); for a gated or private Hugging Face "
                              f"repo, log in (`hf auth login`) or set HF_TOKEN")
        if r.status_code != 206:
            raise SourceError(f"{self.ref}: the server answered HTTP {r.status_code} to a range request "
                              f"(range reads need 206 Partial Content)")
        return r

    def _probe(self) -> tuple[int, str | None]:
        r = self._get(0, 1)
        total = r.headers.get("content-range", "").rpartition("/")[2]
        if not total.isdigit():
            raise SourceError(f"{self.ref}: the server gave no file size "
                              f"(Content-Range {r.headers.get('content-range')!r})")
        self.fetched_bytes += len(r.content)
        return int(total), r.headers.get("x-linked-etag") or r.headers.get("etag")

    def _load_state(self) -> dict:
        try:
            state = json.loads(self._sidecar.read_text())
            return state if self.path.is_file() and self.path.stat().st_size == state.get("size") else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict) -> None:
        tmp = self._sidecar.with_name(self._sidecar.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._sidecar)

    def missing(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Sub-ranges of [start, stop) not in the mirror yet."""
        gaps, pos = [], start
        for lo, hi in self._state["ranges"]:
            if hi <= pos or lo >= stop:
                continue
            if lo > pos:
                gaps.append((pos, lo))
            pos = max(pos, hi)
        if pos < stop:
            gaps.append((pos, stop))
        return gaps

    def ensure(self, start: int, stop: int) -> None:
        """Make bytes [start, stop) of the mirror equal the remote file's."""
        start, stop = max(0, start), min(self.size, stop)
        gaps = self.missing(start, stop)
        if not gaps:
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for lo, hi in gaps:
                for a in range(lo, hi, MAX_REQUEST):
                    b = min(hi, a + MAX_REQUEST)
                    data = self._get(a, b).content
                    if len(data) != b - a:
                        raise SourceError(f"{self.ref}: asked for {b - a} bytes at {a}, got {len(data)}")
                    os.pwrite(fd, data, a)
                    self.fetched_bytes += len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._state["ranges"] = _merge(self._state["ranges"] + [[lo, hi] for lo, hi in gaps])
        self._save_state(self._state)


class RemoteGGUF:
    """A remote GGUF file or split set, mirrored; ``path`` is the local first shard to open."""

    def __init__(self, ref: str, session=None):

        base, _, name = ref.rpartition("/")
        mirror_dir = _cache_root() / hashlib.sha256(base.encode()).hexdigest()[:16]
        m = SPLIT_NAME.match(name)
        names = [name] if m is None else [f"{m['stem']}-{i:05d}-of-{m['count']}.gguf"
                                          for i in range(1, int(m["count"]) + 1)]
        if m is not None and int(m["no"]) != 1:
            raise SourceError(f"{ref}: open a split GGUF set by its first shard (-00001-of-{m['count']})")
        self.files = {mirror_dir / n: RemoteFile(f"{base}/{n}", mirror_dir / n, session) for n in names}
        self.path = mirror_dir / name
        for f in self.files.values():
            self._fetch_header(f)

    @property
    def fetched_bytes(self) -> int:
        return sum(f.fetched_bytes for f in self.files.values())

    def ensure(self, path: Path, start: int, stop: int) -> None:
        self.files[Path(path)].ensure(start, stop)

    @staticmethod
    def _fetch_header(f: RemoteFile) -> None:
        """Fetch a growing prefix until the header parses within the fetched bytes."""
        import numpy as np


        have = min(f.size, HEADER_FIRST)
        while True:
            f.ensure(0, have)
            mm = np.memmap(f.path, mode="r")
            try:
                end = check_header(f.path, memoryview(mm))
                error = None
            except SourceError as e:           # the parse ran into bytes not fetched yet, or a real error
                end, error = None, e
            finally:
                del mm
            if end is not None and end <= have:
                return
            if have >= min(f.size, HEADER_MAX):
                raise SourceError(str(error).replace(str(f.path), f.ref) if error else
                                  f"{f.ref}: the GGUF header is larger than {HEADER_MAX} bytes") from None
            have = min(f.size, HEADER_MAX, max(4 * have, end or 0))
