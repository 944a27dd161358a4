"""grpc, imported the first time something of it is used.

Importing grpc costs 85-110 ms on a 2-core machine (its extension module brings asyncio
with it): more than the rest of a `vaccel run -- true`, which, served over the identity
socket (vaccel_common/side_call.py), may never need it. Modules on that path write
`from vaccel.session.grpc_lazy import grpc` and use it as the module itself; `except grpc.RpcError`
imports it only when an exception actually reaches that clause.
"""

from __future__ import annotations

from typing import Any


class _LazyGrpc:
    def __getattr__(self, name: str) -> Any:
        import grpc  # the import system's lock makes a first use from two threads safe

        return getattr(grpc, name)


grpc: Any = _LazyGrpc()
_error_class: type | None = None
# gRPC's status codes by number, as LeaseError's codes spell them.
_CODE_NAMES = ("ok", "cancelled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
               "permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
               "unimplemented", "internal", "unavailable", "data_loss", "unauthenticated")


class SideRefusal(Exception):
    """The broker's refusal heard on the identity socket, for a caller that asked for it plain
    (BrokerConnection.call's `plain_refusal`): a call that is refused in the normal run of
    things (`vaccel run -- docker run IMAGE true` names a container that has exited already)
    then never imports grpc to be told no. `code`: as LeaseError's ("not_found")."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = _CODE_NAMES[code] if 0 <= code < len(_CODE_NAMES) else "unknown"
        self.details = details


def side_call_error(code: int, details: str) -> Exception:
    """The broker's refusal heard on the identity socket, as the grpc.RpcError a unary
    call raises (code() and details()), so callers handle both alike."""
    import grpc as real

    global _error_class
    if _error_class is None:
        class SideCallError(real.RpcError):
            def __init__(self, status: Any, text: str) -> None:
                super().__init__(text)
                self._status, self._text = status, text

            def code(self) -> Any:
                return self._status

            def details(self) -> str:
                return self._text

        _error_class = SideCallError
    status = next((s for s in real.StatusCode if s.value[0] == code), real.StatusCode.UNKNOWN)
    return _error_class(status, details)
