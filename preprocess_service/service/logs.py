"""Log setup: text for people, or one JSON object per line for log pipelines (log_format=json).

Log calls that concern a job, a step or a rank pass them as ``extra={"job": ..., "step": ...,
"rank": ...}``; the JSON formatter writes them as fields, the text formatter appends them.
"""

from __future__ import annotations

import json
import logging
import time

FIELDS = ("job", "step", "rank", "replica")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update({key: getattr(record, key) for key in FIELDS if hasattr(record, key)})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = " ".join(f"{key}={getattr(record, key)}" for key in FIELDS if hasattr(record, key))
        return f"{text} [{context}]" if context else text


def configure(log_format: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
