"""One line in the Jupyter server's log for a kernel start the broker refused, not two
tracebacks.

A refusal (`--on-busy fail` and no device free) is an answer, not a crash: the provisioner
raises it as an HTTP error so the front end shows the broker's message. On its way out,
jupyter_client logs it with `log.exception` twice (the kernel manager's start wrapper,
then the multi-kernel manager's `_add_kernel_when_ready`), a traceback each, on the
server's logger. This filter, on that logger, makes the first of them one line without
the traceback and drops the second.
"""

from __future__ import annotations

import logging

_SAID = "_vaccel_logged"  # set on the refusal once it has been logged


class RefusalLog(logging.Filter):
    def __init__(self, refusal: type[BaseException]) -> None:
        super().__init__("vaccel-kernel-refusal")
        self.refusal = refusal

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, self.refusal):
            return True
        if getattr(error, _SAID, False):
            return False  # the same refusal, logged again on its way out
        setattr(error, _SAID, True)
        record.msg, record.args = "vaccel kernel start refused: %s", (error,)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def quiet_refusals(log: logging.Logger | logging.LoggerAdapter, refusal: type[BaseException]) -> None:
    """Put the filter on `log` (the server's logger), once."""
    logger = log.logger if isinstance(log, logging.LoggerAdapter) else log
    if not any(isinstance(f, RefusalLog) for f in logger.filters):
        logger.addFilter(RefusalLog(refusal))
