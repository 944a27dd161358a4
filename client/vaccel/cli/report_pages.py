"""`vaccel report` of any size: the ReportPages stream (a page of a few thousand leases at a
time, issue 46), so `--by lease --csv` of a year's million leases is written as it comes
instead of one reply over gRPC's 4 MiB. A broker from before the stream answers
UNIMPLEMENTED and gets the one Report call instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vaccel.cli.common import EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_USAGE, CliError, rpc
from vaccel.session.connection import BrokerConnection, BrokerUnavailable
from vaccel.session.grpc_lazy import grpc
from vaccel_common.v1 import broker_pb2 as pb


def pages(conn: BrokerConnection, request: pb.ReportRequest) -> Iterator[pb.ReportReply]:
    """The report's pages; each carries the period, `by`, the total and rows_hidden."""
    started = False
    try:
        for page in conn.stream("ReportPages", request):
            started = True
            yield page
    except BrokerUnavailable as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED and not started and "accounting" not in (exc.details() or ""):
            yield rpc(conn, "Report", request)  # an older broker: no stream
            return
        code = EXIT_USAGE if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_REFUSED
        raise CliError(exc.details() or exc.code().name, code) from None


def whole(conn: BrokerConnection, request: pb.ReportRequest) -> Any:
    """The report as one reply, its pages' rows together."""
    reply = None
    for page in pages(conn, request):
        if reply is None:
            reply = page
        else:
            reply.rows.extend(page.rows)
    return reply
