//! Busy slots the balancer did not send ("foreign" load): clients that
//! bypass the balancer, other balancers, an agent's view the balancer has
//! no lease for.
//!
//! A report says how many slots the engine had busy when its agent read
//! them; the foreign ones are those less the balancer's own requests
//! running *at that read*. The balancer's count has moved since: it sent
//! requests the engine did not have yet, and ended some it still had. So
//! each endpoint keeps the instants its slots were taken and given back
//! since the last report ([`SlotLog`]); an agent that says when its read
//! of the engine began and how long it took (`read_began_ms_ago`, `read_ended_ms_ago`)
//! lets the balancer count its own requests as they stood then: running
//! now, less those sent after the read ended, plus those ended after it
//! began. That is the most of its own the engine may have counted, so the
//! foreign count is never too high: a report never hides a slot the
//! balancer just freed. Without the age, the most it had in flight since
//! the last report stands for them (then a request that ended just before
//! a client took every slot hides one of them for a report).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The report's own way from its agent (the ages it carries were taken
/// when it was sent): a read is taken to have begun this much earlier, so
/// a request that ended just before it still counts as the balancer's.
const TRANSIT: Duration = Duration::from_millis(5);

/// Changes kept between two reports at most; the oldest go first (they
/// are the likeliest to predate the read).
const MAX_CHANGES: usize = 1024;

/// The endpoint's in-flight changes since its last report.
#[derive(Debug, Default)]
pub(super) struct SlotLog {
    /// When a slot was taken (`true`) or given back (`false`), oldest
    /// first.
    changes: VecDeque<(Instant, bool)>,
    /// The most requests in flight since the last report.
    peak: u32,
}

impl SlotLog {
    /// A slot was taken at `now`; `in_flight` counts it.
    pub(super) fn taken(&mut self, now: Instant, in_flight: u32) {
        self.peak = self.peak.max(in_flight);
        self.push(now, true);
    }

    /// A slot was given back at `now`.
    pub(super) fn given_back(&mut self, now: Instant) {
        self.push(now, false);
    }

    fn push(&mut self, at: Instant, taken: bool) {
        if self.changes.len() == MAX_CHANGES {
            self.changes.pop_front();
        }
        self.changes.push_back((at, taken));
    }

    /// The most of the balancer's requests that may have been running
    /// when the engine was read (`read`: when the read began and ended,
    /// as ages before `now`, the end no older than the beginning, as
    /// [`crate::protocol::AgentReport::read_window`] gives them; `None`:
    /// the agent does not say), with
    /// `in_flight` running now; then starts over for the next report.
    pub(super) fn own_at_read(
        &mut self,
        now: Instant,
        read: Option<(Duration, Duration)>,
        in_flight: u32,
    ) -> u32 {
        let window = read.and_then(|(began, ended)| {
            Some((now.checked_sub(began + TRANSIT)?, now.checked_sub(ended)?))
        });
        let own = match window {
            Some((began, ended)) => {
                let (mut taken, mut given_back) = (0u32, 0u32);
                for &(at, took) in self.changes.iter().rev() {
                    if at < began {
                        break;
                    }
                    if took && at >= ended {
                        taken += 1;
                    } else if !took {
                        given_back += 1;
                    }
                }
                (in_flight + given_back).saturating_sub(taken)
            }
            None => self.peak,
        };
        self.changes.clear();
        self.peak = in_flight;
        own
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_requests_are_counted_as_they_stood_at_the_read() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut log = SlotLog::default();
        log.taken(t0, 1);
        log.taken(t0 + ms(10), 2);
        // Read at +50 ms: both running. One ends at +60, one more is sent
        // at +70; the report comes at +80 with the read 30 ms old.
        log.given_back(t0 + ms(60));
        log.taken(t0 + ms(70), 2);
        assert_eq!(log.own_at_read(t0 + ms(80), Some((ms(30), ms(30))), 2), 2);
        // A request that ended before the read is not running at it
        // (without the age, the peak since the last report stands).
        log.given_back(t0 + ms(100));
        let mut without_age = SlotLog::default();
        without_age.taken(t0, 2);
        without_age.given_back(t0 + ms(100));
        assert_eq!(log.own_at_read(t0 + ms(200), Some((ms(50), ms(50))), 1), 1);
        assert_eq!(without_age.own_at_read(t0 + ms(200), None, 1), 2);
        // A read that took a while: a request sent during it may be
        // counted by the engine, one that ended during it may be too.
        log.taken(t0 + ms(310), 2);
        log.given_back(t0 + ms(320));
        log.taken(t0 + ms(330), 2);
        let read = Some((ms(100), ms(75)));
        assert_eq!(
            log.own_at_read(t0 + ms(400), read, 2),
            2,
            "two ran during it"
        );
        // An age beyond the clock, or no change at all: what runs now.
        assert_eq!(
            log.own_at_read(t0 + ms(500), Some((ms(1) * 1_000_000, ms(0))), 1),
            1
        );
    }

    #[test]
    fn the_log_is_bounded() {
        let t0 = Instant::now();
        let mut log = SlotLog::default();
        for i in 0..(MAX_CHANGES as u32 * 3) {
            log.taken(t0, i);
        }
        assert_eq!(log.changes.len(), MAX_CHANGES);
    }
}
