"""hivemind's ``hivemind.utils`` names that training scripts import: :func:`get_dht_time`,
:func:`get_logger`, :class:`PerformanceEMA`, :class:`ValueWithExpiration`, ``DHTExpiration``."""

from hivemesh.utils.logging import get_logger
from hivemesh.utils.performance_ema import PerformanceEMA
from hivemesh.utils.timed_storage import (
    MAX_DHT_TIME_DISCREPANCY_SECONDS,
    DHTExpiration,
    ValueWithExpiration,
    get_dht_time,
)

__all__ = [
    "DHTExpiration",
    "MAX_DHT_TIME_DISCREPANCY_SECONDS",
    "PerformanceEMA",
    "ValueWithExpiration",
    "get_dht_time",
    "get_logger",
]
