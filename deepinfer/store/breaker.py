"""A circuit breaker in front of the persistent store.

Closed: calls pass. After `failure_threshold` consecutive failures it opens: calls are refused
at once (the engine sees misses and recomputes) instead of each waiting for a timeout. Every
`probe_interval_s` one call is let through as a probe (half-open); its success closes the
breaker, its failure keeps it open for another interval.
"""

from __future__ import annotations

import enum
import logging
import threading

from deepinfer.store.clock import SYSTEM_CLOCK, Clock

logger = logging.getLogger(__name__)


class BreakerState(enum.IntEnum):
    # Integer values so the state exports directly as a gauge.
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        probe_interval_s: float = 5.0,
        clock: Clock = SYSTEM_CLOCK,
        name: str = "kv-store",
    ):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.probe_interval_s = probe_interval_s
        self.clock = clock
        self.name = name
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self._next_probe_at = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a call go to the store now? In the open state, True once per probe interval."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN and self.clock.now() >= self._next_probe_at:
                self.state = BreakerState.HALF_OPEN
                return True
            return False

    def refusing(self) -> bool:
        """Would a call be refused now? Unlike allow(), this never claims the probe."""
        with self._lock:
            if self.state is BreakerState.OPEN:
                return self.clock.now() < self._next_probe_at
            return self.state is BreakerState.HALF_OPEN

    def record_success(self) -> None:
        with self._lock:
            if self.state is not BreakerState.CLOSED:
                logger.warning("%s: store answered again, circuit closed", self.name)
            self.state = BreakerState.CLOSED
            self.consecutive_failures = 0

    def record_failure(self, error: object) -> None:
        with self._lock:
            self.consecutive_failures += 1
            if self.state is BreakerState.HALF_OPEN or (
                self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold
            ):
                if self.state is BreakerState.CLOSED:
                    self.times_opened += 1
                    logger.warning(
                        "%s: circuit opened after %d consecutive errors (last: %s); serving misses, "
                        "probing every %.1fs",
                        self.name,
                        self.consecutive_failures,
                        error,
                        self.probe_interval_s,
                    )
                self.state = BreakerState.OPEN
                self._next_probe_at = self.clock.now() + self.probe_interval_s
