"""2023 `slapo.get_logger(name, level)`: a logger whose calls take `ranks=` (and `group=`), so
a message prints only on the chosen ranks of a distributed job."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist


def _rank(group=None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group)
    return 0


class RankLogger(logging.LoggerAdapter):
    """`logger.info(msg, ranks=0)` logs on rank 0 only; `ranks=None` logs everywhere."""

    def log(self, level: int, msg: Any, *args, ranks=None, group=None, **kwargs) -> None:
        if ranks is not None:
            wanted = {ranks} if isinstance(ranks, int) else set(ranks)
            if _rank(group) not in wanted:
                return
        super().log(level, msg, *args, **kwargs)

    # LoggerAdapter.debug/info/warning/error/critical all call self.log, so they take ranks=.


def get_logger(name: str = "Slapo", level: int = logging.INFO) -> RankLogger:
    """A rank-aware logger (one stream handler per name, added once)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    return RankLogger(logger, {})
