"""A TLS handshake in memory between certificates the chart generated: what a caller (or the
API server) and the server would do over a socket, without one."""

from __future__ import annotations

import base64
import ssl
import tempfile
from pathlib import Path


def handshake(server: dict, trusted_ca: str, hostname: str, *, client: dict | None = None
              ) -> ssl.SSLError | None:
    """None when a client trusting only `trusted_ca` (base64 PEM) completes a handshake with
    `server` (`tls.crt`/`tls.key`, base64) for `hostname`, else the error. With `client`, the
    server also requires a client certificate signed by its own `ca.crt` (what
    `--tls-client-ca` does) and the client presents that pair."""
    with tempfile.TemporaryDirectory() as tmp:
        def file(name: str, b64: str) -> str:
            path = Path(tmp, name)
            path.write_bytes(base64.b64decode(b64))
            return str(path)
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(file("s.crt", server["tls.crt"]),
                                   file("s.key", server["tls.key"]))
        client_ctx = ssl.create_default_context(cafile=file("trusted.crt", trusted_ca))
        if client is not None:
            server_ctx.load_verify_locations(file("ca.crt", server["ca.crt"]))
            server_ctx.verify_mode = ssl.CERT_REQUIRED
            client_ctx.load_cert_chain(file("c.crt", client["tls.crt"]),
                                       file("c.key", client["tls.key"]))
        c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
        client_end = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
        server_end = server_ctx.wrap_bio(s_in, s_out, server_side=True)
        done = {"client": False, "server": False}
        for _ in range(10):
            for side, end in (("client", client_end), ("server", server_end)):
                if not done[side]:
                    try:
                        end.do_handshake()
                        done[side] = True
                    except ssl.SSLWantReadError:
                        pass
                    except ssl.SSLError as e:
                        return e
            s_in.write(c_out.read())
            c_in.write(s_out.read())
            if all(done.values()):
                # TLS 1.3: the server checks the client's certificate after the client is done
                try:
                    client_end.read(1)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError as e:
                    return e
                return None
        raise AssertionError(f"the handshake for {hostname} neither completed nor failed: "
                             f"{done}")
