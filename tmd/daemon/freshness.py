"""Whether the daemon's own view of the cluster is current: its MQTT connection is up
and its ingest keeps up.

A finding of absence (a node's heartbeats stopped, a rank went silent) is only as
good as the daemon's intake: while the broker is unreachable or ingest lags, every
node looks silent, and a retained Last Will replayed after an outage looks like a
loss. So the daemon measures its own lag on one clock, with no skew in it: ingest
publishes a probe stamped with the daemon's clock on a topic it alone subscribes to,
and the probe comes back through the broker behind every message published before
it. Once a probe sent at ``t`` is read, the view holds everything published up to
``t``.

The view is *stale* while the connection is down, or the newest probe read was sent
more than ``interval_s + max_lag_s`` ago (a probe is late, or none came back), or
the last probe took longer than ``max_lag_s``. When it is current again it *settles*
for ``settle_s``; only then is it trusted (``since``), and silences count from the
moment it became current, not from before the outage. Staleness is judged when
asked, so a reader that runs after the event loop was blocked sees the gap at once.

A probe that comes back in time proves the view is recent, not that it is whole: a
broker drops messages queued for a subscriber that lags (mosquitto past
``max_queued_messages``) and passes the probe behind them. So ingest also reports
messages it knows were lost (gaps in the agents' sequence numbers, ``tmd.wire``):
a loss settles the view anew, as a return from staleness does, and silences count
from it.
"""

from __future__ import annotations

import math


class Freshness:
    def __init__(self, *, interval_s: float, max_lag_s: float, settle_s: float) -> None:
        self.interval_s = interval_s
        self.max_lag_s = max_lag_s
        self.settle_s = settle_s
        self.connected = False
        self.current_as_of = -math.inf  # send time of the newest probe read back
        self.last_lag_s = 0.0
        self.fresh_since: float | None = None  # when it last became current

    @classmethod
    def always(cls) -> Freshness:
        """A view fed directly (tests, the simulator, benchmarks): always trusted."""
        view = cls(interval_s=math.inf, max_lag_s=math.inf, settle_s=0.0)
        view.connected, view.current_as_of, view.fresh_since = True, 0.0, -math.inf
        return view

    # -- what ingest tells it ----------------------------------------------------------

    def connection(self, up: bool, now: float) -> None:
        """The broker connection came up (subscribed) or went down. Up is not current
        yet: the first probe read back makes it so."""
        self.connected = up
        if not up:
            self.fresh_since = None

    def answered(self, sent_at: float, now: float) -> None:
        """A probe sent at ``sent_at`` was read at ``now``."""
        was_stale = self.stale(now)
        self.current_as_of = max(self.current_as_of, sent_at)
        self.last_lag_s = max(0.0, now - sent_at)
        if not self.stale(now) and (was_stale or self.fresh_since is None):
            self.fresh_since = now

    def lost(self, now: float) -> bool:
        """Messages published to this daemon were lost on the way, found at ``now``:
        a silence before it proves nothing. Returns whether the view was trusted."""
        trusted = self.since(now) is not None
        if self.fresh_since == -math.inf:
            return trusted  # ``always``: a view fed directly has nothing on the way
        if self.fresh_since is not None and not self.stale(now):
            self.fresh_since = now
        return trusted

    # -- what readers ask --------------------------------------------------------------

    def lag_s(self, now: float) -> float:
        """How far behind the view may be: the last probe's delay, or how overdue the
        next one is."""
        overdue = now - self.current_as_of - self.interval_s
        return max(self.last_lag_s, overdue if math.isfinite(overdue) else math.inf)

    def stale(self, now: float) -> bool:
        return not self.connected or self.lag_s(now) > self.max_lag_s

    def since(self, now: float) -> float | None:
        """When the view became current, if it is trusted now (current, and settled);
        None while it is stale or settling. Absence is measured from here."""
        if self.fresh_since is None or self.stale(now):
            return None
        if now - self.fresh_since < self.settle_s:
            return None
        return self.fresh_since

    def state(self, now: float) -> str:
        """``stale``, ``settling`` or ``current``."""
        if self.stale(now) or self.fresh_since is None:
            return "stale"
        return "settling" if now - self.fresh_since < self.settle_s else "current"
