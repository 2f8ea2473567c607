//! Circuit breaker: `failures` consecutive upstream failures (connection
//! errors and 5xx answers, never 4xx) open the circuit for `backoff`; the
//! endpoint then comes back on its own. A failure right after it comes back
//! opens it again for twice as long (up to `max_backoff`); a success closes it
//! and forgets the failures.
//!

use std::time::{Duration, Instant};

use super::{EndpointId, EndpointLedger};

/// The circuit breaker's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit; 0 disables the breaker.
    pub failures: u32,
    /// How long the circuit stays open the first time.
    pub backoff: Duration,
    /// The longest it stays open after repeated trips.
    pub max_backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 3,
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Breaker {
    pub(super) consecutive_failures: u32,
    /// Times the circuit opened since the last success.
    trips: u32,
    pub(super) open_until: Option<Instant>,
}

impl Breaker {
    pub(super) fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|t| now < t)
    }

    /// Counts a failure; `true` when it opened the circuit.
    pub(super) fn failure(&mut self, now: Instant, config: &BreakerConfig) -> bool {
        if config.failures == 0 || self.is_open(now) {
            return false;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.consecutive_failures < config.failures {
            return false;
        }
        let backoff = config
            .backoff
            .saturating_mul(1u32 << self.trips.min(16))
            .min(config.max_backoff);
        self.open_until = Some(now + backoff);
        self.trips = self.trips.saturating_add(1);
        true
    }

    pub(super) fn success(&mut self) {
        *self = Breaker::default();
    }

    /// It remembers no failure: a success would change nothing.
    pub(super) fn is_clear(&self) -> bool {
        self.consecutive_failures == 0 && self.trips == 0 && self.open_until.is_none()
    }
}

impl EndpointLedger {
    /// Records how a request to `endpoint` ended: `false` for a connection
    /// failure or a 5xx answer. `true` when this failure opened the circuit.
    pub(crate) fn record_outcome(&mut self, endpoint: EndpointId, ok: bool, now: Instant) -> bool {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return false;
        };
        let was_clear = ep.breaker.is_clear();
        let opened = if ok {
            ep.breaker.success();
            false
        } else {
            ep.breaker.failure(now, &self.scheduling.breaker)
        };
        match (was_clear, ep.breaker.is_clear()) {
            (true, false) => self.failing += 1,
            (false, true) => self.failing -= 1,
            _ => {}
        }
        opened
    }

    /// Endpoints whose breaker remembers a failure: while there are none,
    /// a success need not be recorded.
    pub(crate) fn failing(&self) -> usize {
        self.failing
    }
}
