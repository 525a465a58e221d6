"""A server TLS context that follows its certificate files on disk.

Kubernetes rotates a mounted Secret by swapping a symlink, cert-manager renews certificates
in place: either way the files change under a running server. Each new connection asks for the
context; when either file's (mtime, size, inode) changed since the last load, a new context is
built and swapped in. A half-rotated pair (new cert, old key) fails to load: the old context
keeps serving and the next connection tries again, so a rotation never takes the webhook down.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int, int], tuple[int, int, int]]


class TLSError(Exception):
    """The certificate or key cannot be loaded; the message names the files and the reason."""


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def load_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise TLSError(f"cannot load TLS certificate {cert_file} with key {key_file}: "
                       f"{getattr(e, 'strerror', None) or e}") from None
    return ctx


class ReloadingContext:
    """`current()` is the context to use for the next connection."""

    def __init__(self, cert_file: str, key_file: str,
                 loader: Callable[[str, str], ssl.SSLContext] = load_context) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._loader = loader
        self._lock = threading.Lock()
        try:
            stamp = self._stamp()
        except OSError as e:
            raise TLSError(f"cannot read TLS files {cert_file}, {key_file}: "
                           f"{e.strerror or e}") from None
        self._context = loader(cert_file, key_file)  # fail at start: no certificate, no server
        self._stamp_loaded: Stamp = stamp
        self.reloads = 0

    def _stamp(self) -> Stamp:
        return _stamp(self.cert_file), _stamp(self.key_file)

    def current(self) -> ssl.SSLContext:
        try:
            stamp = self._stamp()
        except OSError:
            return self._context  # mid-rotation (a file briefly missing): keep serving
        if stamp == self._stamp_loaded:
            return self._context
        with self._lock:
            if stamp != self._stamp_loaded:
                try:
                    self._context = self._loader(self.cert_file, self.key_file)
                except TLSError as e:
                    log.warning("keeping the previous TLS certificate: %s", e)
                    return self._context
                self._stamp_loaded = stamp
                self.reloads += 1
                log.info("reloaded TLS certificate %s", self.cert_file)
            return self._context
