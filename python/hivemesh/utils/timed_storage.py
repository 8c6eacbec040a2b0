"""DHT time (hivemind's ``hivemind.utils.timed_storage`` names that scripts import)."""

from hivemesh._hivemesh import get_dht_time
from hivemesh.dht import ValueWithExpiration

__all__ = ["DHTExpiration", "MAX_DHT_TIME_DISCREPANCY_SECONDS", "ValueWithExpiration", "get_dht_time"]

#: A DHT expiration time: seconds since the UNIX epoch (:func:`get_dht_time` + seconds).
DHTExpiration = float

#: How far two peers' DHT clocks may differ, in seconds (hivemind's value).
MAX_DHT_TIME_DISCREPANCY_SECONDS = 3
