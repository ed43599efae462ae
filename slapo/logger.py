"""2023's module path `slapo.logger`: `from slapo.logger import get_logger` (the logger whose
calls take `ranks=` and `group=`; `slapo.compat.logger`)."""

from .compat.logger import RankLogger, get_logger

__all__ = ["RankLogger", "get_logger"]
