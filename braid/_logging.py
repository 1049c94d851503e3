"""braid's log output: one line per event that matters, on stderr, under the `braid` logger.

The level comes from BRAID_LOG_LEVEL (default INFO). braid never touches the root logger.
"""

from __future__ import annotations

import logging
import os


def configure_logging(level: str | None = None) -> None:
    logger = logging.getLogger("braid")
    level = (level or os.environ.get("BRAID_LOG_LEVEL") or "INFO").upper()
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("[braid %(asctime)s] %(message)s", datefmt="%H:%M:%S")
        )
        logger.addHandler(handler)
        logger.propagate = False
