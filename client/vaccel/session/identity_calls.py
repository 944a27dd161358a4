"""One call over the broker's identity socket (vaccel_common/side_call.py) without
protobuf or the socket module: what vaccel/entry.py and vaccel/run/quick_run.py send and read.
"""

import os

_TIMEOUT_S = 30.0  # as the full client's calls (vaccel/session/connection.py); then the full CLI takes over


def folder_is_safe(path: str) -> bool:
    """/tmp/vaccel-$UID is a fixed name in a shared folder: a broker there is talked to only
    when the folder is ours (the full CLI refuses it with a message: vaccel/session/connection.py)."""
    folder = os.path.dirname(os.path.normpath(path))
    if folder != f"/tmp/vaccel-{os.getuid()}":
        return True
    try:
        return os.stat(folder).st_uid == os.getuid()
    except FileNotFoundError:
        return True  # nothing there: the connection fails, the full CLI says so


def ask(identity_path: str, method: str, request: bytes) -> tuple[int, bytes] | None:
    """(code, reply) of one call over the identity socket (vaccel_common/side_call.py): the
    reply when the code is 0, else the refusal's words. None when no answer came (an older
    broker, a connection past the broker's bounds: each closes without one). Raises
    OSError when the socket cannot be reached."""
    import _socket

    from vaccel_common.side_call import MAX_HEADER_BYTES, parse_reply_header, request_header

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(_TIMEOUT_S)
        sock.connect(identity_path)
        sock.sendall(request_header(method, len(request)) + request)
        chunks = []
        while chunk := sock.recv(1 << 16):  # the broker closes after its reply
            chunks.append(chunk)
    finally:
        sock.close()
    token_line, _, rest = b"".join(chunks).partition(b"\n")
    header_line, _, payload = rest.partition(b"\n")
    header = parse_reply_header(header_line) if len(header_line) < MAX_HEADER_BYTES else None
    if not token_line.startswith(b'{"token"') or header is None or header[1] != len(payload):
        return None
    return header[0], payload
