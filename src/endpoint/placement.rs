//! Placement by predicted time to first token: the wait-or-go rule.
//!
//! When a request could go now (some endpoint takes it) but a saturated
//! endpoint holds more of its prompt, the request waits for that endpoint
//! exactly while waiting is predicted to be quicker than going:
//!
//! - going costs the prefill of what the chosen free endpoint does not
//!   cache: uncached tokens × its prefill time per token;
//! - waiting costs the wait for a slot there, (requests before it + 1) ×
//!   its service time ÷ its slots (the requests before it: those already
//!   held for it in this dispatch pass, those queued for it by their
//!   sessions and its engine's own queue), plus the prefill of what it does
//!   not cache (nothing, for the endpoint a session's conversation is on).
//!
//! Going while a saturated endpoint holds more of the prompt is a spill. A
//! spill waits first 1 % of the prefill it will pay ([`spill_delay`]), and
//! then passes the requests that wait for the free endpoint only where
//! that evens out the work: from an endpoint carrying at least one request
//! per slot more than the mean to one carrying at least one fewer
//! ([`super::balance`]). A burst of conversations starting at once then
//! puts each group where its prompt is, instead of the first group's
//! spills taking every free server before the other groups' first turns
//! arrive (each server then prefilled two or three groups' prompts cold);
//! a popular prompt spreads to the servers below their share, and a group
//! of its fair share stays on its server.
//!
//! Every rate is the endpoint's own, learned from its answers
//! ([`super::CostModel`]). So a long conversation waits for its server,
//! a short prompt never does, and a popular prefix spreads to a second
//! server once the requests queued for the first cost more than one more
//! prefill. `scheduling.affinityHold` only bounds the wait, in case the
//! estimates are wrong; the dispatcher owns that clock. (Counting what a
//! request already waited against the prefill, the ski-rental bound, was
//! tried: it moved conversations away from their cache under load and cost
//! throughput; see BENCHMARKS.md.)

use std::time::{Duration, Instant};

use super::adapters::Wanted;
use super::selection::SessionPlace;
use super::{Endpoint, EndpointId, EndpointLedger, Route};

/// Bytes of prompt text per token assumed to turn cached blocks into
/// tokens (a prefix block is `block_bytes` of text).
pub(super) const BYTES_PER_TOKEN: u64 = 4;

/// Where a queued request stands when a slot is free
/// ([`EndpointLedger::at_home`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// It can go now where nothing would serve it better by its cache.
    Yes,
    /// It can go now, but a saturated endpoint has more of its prompt (or
    /// its session); `waits`: the wait-or-go rule would wait for it.
    Elsewhere { waits: bool },
    /// No endpoint can take it now.
    Busy,
}

/// Requests held for each endpoint so far in one dispatch pass: a request
/// held for an endpoint waits behind them. Few entries (holds per pass are
/// bounded), so a list.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    held: Vec<(EndpointId, u32)>,
}

/// What a request placed by the wait-or-go rule may do in a dispatch pass
/// ([`EndpointLedger::pick`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holding<'a> {
    /// The requests held so far in the pass.
    pub waits: &'a Waits,
    /// Whether it may prefill cold now what a busy endpoint holds: its
    /// spill delay is over ([`spill_delay`]).
    pub may_spill: bool,
}

/// What the wait-or-go rule says of a request some endpoint takes now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum WaitOrGo {
    /// Wait for this saturated endpoint.
    Wait(EndpointId),
    /// Go, although a saturated endpoint holds more of its prompt (the
    /// quickest of those, `holder`): a spill, which prefills `cold_ms`
    /// again.
    Spill { cold_ms: f64, holder: EndpointId },
    /// Go: no saturated endpoint would serve it sooner by its cache.
    Go,
}

/// Of a spill's predicted cold prefill, the share it waits first (1 %).
const SPILL_PATIENCE: f64 = 0.01;

/// How long a request waits before it spills (prefills cold what a busy
/// endpoint holds, because waiting for that one costs more): 1 % of that
/// prefill. Requests at home on the free endpoint that come meanwhile (a
/// burst of conversations starting at once: its other groups' first
/// turns) take the slot first; placed one by one as they came, the first
/// group's spills would take every free server before the others arrive,
/// and each of those would then prefill two or three groups' prompts cold.
pub(super) fn spill_delay(cold_ms: f64) -> Duration {
    Duration::from_secs_f64((cold_ms * SPILL_PATIENCE).clamp(0.0, 60_000.0) / 1_000.0)
}

impl Waits {
    /// Requests held for `id` so far.
    pub(crate) fn ahead(&self, id: EndpointId) -> u32 {
        self.held
            .iter()
            .find(|(e, _)| *e == id)
            .map_or(0, |(_, n)| *n)
    }

    /// Counts one more request held for `id`.
    pub(crate) fn add(&mut self, id: EndpointId) {
        match self.held.iter_mut().find(|(e, _)| *e == id) {
            Some((_, n)) => *n += 1,
            None => self.held.push((id, 1)),
        }
    }
}

impl Endpoint {
    /// Predicted wait for a slot here: 0 when it takes the request now;
    /// else one service time per slot for each request it must serve
    /// first (`ahead` held for it in this pass, those queued for it by
    /// their sessions, its engine's queue) and this one. A slot busy with
    /// work no balancer sent counts as a request ahead too: how far along
    /// that work is, nothing says (a client that bypasses the balancers
    /// may hold its slots for seconds), so it is taken as a whole service.
    pub(super) fn predicted_wait_ms(&self, takes: bool, ahead: u32) -> f64 {
        if takes {
            return 0.0;
        }
        let queued = self.agent.as_ref().map_or(0, |a| a.report.requests_waiting);
        let before = f64::from(ahead)
            + f64::from(self.queued_home)
            + f64::from(queued)
            + f64::from(self.foreign_busy)
            + 1.0;
        before * self.cost.service_ms.ms() / f64::from(self.slots_total().max(1))
    }

    /// Whether a conversation whose last turn ran here finds it cached
    /// here: unless its engine's answers say it keeps no cache
    /// ([`super::CacheTruth::keeps_nothing`]), and then nothing here is
    /// worth waiting for.
    pub(super) fn keeps_conversations(&self) -> bool {
        !self.cache.keeps_nothing()
    }

    /// Predicted time to load a LoRA adapter here.
    pub(super) fn predicted_adapter_load_ms(&self) -> f64 {
        self.cost.adapter_load_ms.ms()
    }

    /// Predicted prefill of `uncached` prompt tokens here.
    pub(super) fn predicted_prefill_ms(&self, uncached: u64) -> f64 {
        uncached as f64 * self.cost.prefill_ms_per_token.ms()
    }
}

impl EndpointLedger {
    /// The route's prompt tokens: its estimate, and at least what its
    /// prefix blocks hold (a route may carry no estimate).
    pub(super) fn prompt_tokens(&self, route: &Route) -> u64 {
        let block_bytes = self.scheduling.prefix.block_bytes as u64;
        route
            .tokens
            .prompt
            .max(route.prefix.len() as u64 * block_bytes / BYTES_PER_TOKEN)
    }

    /// Tokens of the route's prompt an endpoint holding `matched` of its
    /// leading blocks has cached.
    pub(super) fn cached_tokens(&self, route: &Route, matched: usize) -> u64 {
        let block_bytes = self.scheduling.prefix.block_bytes as u64;
        (matched as u64 * block_bytes / BYTES_PER_TOKEN).min(self.prompt_tokens(route))
    }

    /// The wait-or-go rule (module docs): the saturated endpoint `route`
    /// should wait for rather than go to `go`, which takes it now, if any.
    /// `bound`: the saturated endpoint its session is on (its conversation
    /// counts as cached there; in hard mode it is always waited for).
    /// `wanted`: its adapter ([`EndpointLedger::adapter_wanted`]).
    pub(super) fn wait_target(
        &self,
        route: &Route,
        go: EndpointId,
        bound: Option<EndpointId>,
        waits: &Waits,
        wanted: Option<&Wanted>,
        now: Instant,
    ) -> WaitOrGo {
        if let Some(id) = bound.filter(|_| route.waits_hard(self.scheduling.sessions.hard)) {
            return WaitOrGo::Wait(id);
        }
        let prompt = self.prompt_tokens(route);
        let scored = self.scheduling.scorers.prefix_cache > 0.0 && !route.prefix.is_empty();
        let go_endpoint = &self.endpoints[&go];
        let go_matched = if scored {
            go_endpoint.prefix.matched(&route.prefix)
        } else {
            0
        };
        // A request for a LoRA adapter waits for its load where the
        // adapter is not resident.
        let load_ms = |e: &Endpoint| match wanted {
            Some(w) if e.residency(&w.name).loads() => e.predicted_adapter_load_ms(),
            _ => 0.0,
        };
        let go_ms = go_endpoint
            .predicted_prefill_ms(prompt - self.cached_tokens(route, go_matched))
            + load_ms(go_endpoint);
        if go_ms <= 0.0 {
            return WaitOrGo::Go;
        }
        let ttft = |e: &Endpoint, cached: u64| {
            e.predicted_wait_ms(false, waits.ahead(e.id))
                + e.predicted_prefill_ms(prompt - cached)
                + load_ms(e)
        };
        // The quickest saturated endpoint, if quicker than going.
        let mut best: Option<(f64, EndpointId)> = None;
        let mut consider = |e: &Endpoint, cached: u64| {
            let ms = ttft(e, cached);
            if best.is_none_or(|b| (ms, e.id) < b) {
                best = Some((ms, e.id));
            }
        };
        let bound = bound.and_then(|id| self.endpoints.get(&id));
        if let Some(e) = bound.filter(|e| e.keeps_conversations()) {
            consider(e, prompt);
        }
        if scored {
            self.busy_holding_more(route, go_matched, now, |e, matched| {
                consider(e, self.cached_tokens(route, matched));
            });
        }
        if let Some(w) = wanted {
            self.busy_holding_adapter(route, w, go, now, |e| {
                let matched = if scored {
                    e.prefix.matched(&route.prefix)
                } else {
                    0
                };
                consider(e, self.cached_tokens(route, matched));
            });
        }
        match best {
            Some((ms, id)) if ms < go_ms => WaitOrGo::Wait(id),
            Some((_, holder)) => WaitOrGo::Spill {
                cold_ms: go_ms,
                holder,
            },
            None => WaitOrGo::Go,
        }
    }

    /// Calls `f` with each saturated (eligible) endpoint that holds more
    /// than `than` of the route's leading blocks, and how many it holds.
    fn busy_holding_more(
        &self,
        route: &Route,
        than: usize,
        now: Instant,
        mut f: impl FnMut(&Endpoint, usize),
    ) {
        let Some(next_block) = route.prefix.get(than) else {
            return;
        };
        let config = self.saturation;
        let busy_here =
            |e: &&Endpoint| e.fits(route) && e.eligible(now) && !e.takes(route, now, &config);
        let mut look = |e: &Endpoint| {
            let matched = e.prefix.matched(&route.prefix);
            if matched > than {
                f(e, matched);
            }
        };
        // Whoever holds more leading blocks holds the block right after
        // the first `than`: its holders are every endpoint to look at.
        // When a prompt many endpoints saw has more holders than the route
        // has endpoints, those are fewer.
        let holders = self.holders.of(*next_block);
        let serving = match &route.subset {
            Some(s) => s.len(),
            None => {
                let model = route.model.as_deref();
                self.ranking.ranked_len(model) + self.ranking.unranked_len(model)
            }
        };
        if holders.len() <= serving {
            holders
                .iter()
                .filter_map(|id| self.endpoints.get(id))
                .filter(busy_here)
                .for_each(&mut look);
        } else {
            self.serving(route).filter(busy_here).for_each(&mut look);
        }
    }

    /// Whether `route` can go now to an endpoint where it is at home: no
    /// saturated endpoint holds more of its prompt, and its session's
    /// endpoint, if it has one, takes it. Such a request loses nothing by
    /// going now, so a free slot should be its before it is a request's
    /// that would prefill its prompt there cold (the dispatcher places
    /// these first). Read only; a route limited to a subset is never at
    /// home here (it is placed in turn).
    pub(crate) fn at_home(&self, route: &Route, now: Instant) -> Home {
        if route.subset.is_some() {
            return Home::Elsewhere { waits: false };
        }
        let mut bound = None;
        if let Some(session) = route.session {
            match self.session_endpoint(route, session, now) {
                SessionPlace::Takes(_) => return Home::Yes,
                // Its conversation is on a saturated endpoint.
                SessionPlace::Saturated(id) => bound = Some(id),
                SessionPlace::Gone | SessionPlace::None
                    if self.at_rendezvous_home(route, session, now) =>
                {
                    return Home::Yes
                }
                SessionPlace::Gone | SessionPlace::None => {}
            }
        }
        let wanted = self.adapter_wanted(route, now);
        let Some(go) = self.choose_by_score(route, wanted.as_ref(), now) else {
            return Home::Busy;
        };
        let scored = self.scheduling.scorers.prefix_cache > 0.0 && !route.prefix.is_empty();
        let mut more_elsewhere = bound.is_some_and(|id| self.endpoints[&id].keeps_conversations());
        if scored && !more_elsewhere {
            let go_matched = self.endpoints[&go].prefix.matched(&route.prefix);
            self.busy_holding_more(route, go_matched, now, |_, _| more_elsewhere = true);
        }
        if let Some(w) = wanted.as_ref().filter(|_| !more_elsewhere) {
            self.busy_holding_adapter(route, w, go, now, |_| more_elsewhere = true);
        }
        if !more_elsewhere {
            return Home::Yes;
        }
        let waits = !self.scheduling.affinity_hold.is_zero()
            && matches!(
                self.wait_target(route, go, bound, &Waits::default(), wanted.as_ref(), now),
                WaitOrGo::Wait(_)
            );
        Home::Elsewhere { waits }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::endpoint::{Lease, Pick, Timing};
    use crate::protocol::tests::report;
    use crate::tokens::TokenEstimate;

    /// Endpoints `a` (port 1) and `b` (port 2), one slot each; `a` is busy
    /// with a prompt of `cached` blocks (64 tokens each), so it holds them.
    fn a_busy_with(cached: u64, now: Instant) -> (EndpointLedger, Lease) {
        let mut ledger = EndpointLedger::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let addr = format!("127.0.0.1:{port}");
            ledger.apply_report(report(id, &addr, 1), addr.parse().unwrap(), now);
        }
        let Pick::Lease(on_a) = ledger.pick(&prompt(cached, 0), now, None) else {
            panic!("a free endpoint takes it");
        };
        assert_eq!(on_a.addr.port(), 1);
        (ledger, on_a)
    }

    /// A prompt whose first `blocks` blocks are the shared ones, of
    /// `tokens` tokens in all (at least what the blocks hold).
    fn prompt(blocks: u64, tokens: u64) -> Route {
        Route {
            prefix: (1..=blocks).collect(),
            tokens: TokenEstimate {
                prompt: tokens,
                ..Default::default()
            },
            ..Route::default()
        }
    }

    /// Teaches the endpoint of `lease` its costs: `prefill_ms` per 1,000
    /// uncached tokens and `service_ms` per request.
    fn learn(ledger: &mut EndpointLedger, lease: &Lease, prefill_ms: u64, service_ms: u64) {
        for _ in 0..crate::endpoint::cost::WINDOW {
            ledger.observe_timing(
                lease,
                &Timing {
                    prefilled_tokens: 1_000,
                    prefill: Some(Duration::from_millis(prefill_ms)),
                    service: Some(Duration::from_millis(service_ms)),
                    ..Timing::default()
                },
            );
        }
    }

    fn choice(ledger: &mut EndpointLedger, route: &Route, waits: &Waits, now: Instant) -> u16 {
        let holding = Holding {
            waits,
            may_spill: true,
        };
        match ledger.choose(route, now, Some(holding)) {
            super::super::Choice::Hold(id) => ledger.endpoints[&id].addr.port() + 100,
            super::super::Choice::Endpoint(id) => ledger.endpoints[&id].addr.port(),
            super::super::Choice::Delay(..) | super::super::Choice::Busy => 0,
        }
    }
    const HOLD_FOR_A: u16 = 101;
    const GO_TO_B: u16 = 2;

    #[test]
    fn a_long_prompt_cached_on_a_busy_server_waits_a_short_one_goes() {
        let now = Instant::now();
        let (mut ledger, on_a) = a_busy_with(40, now);
        // a: 1 ms per token to prefill, 400 ms per request on its 1 slot.
        learn(&mut ledger, &on_a, 1_000, 400);
        let none = Waits::default();
        // 2,560 of 2,688 tokens cached on a: 400 + 128 ms there against
        // 2,688 ms of prefill on b (the default rate, 1 ms per token).
        assert_eq!(choice(&mut ledger, &prompt(42, 0), &none, now), HOLD_FOR_A);
        // A short prompt: 3 of 4 blocks cached on a, 400 + 64 ms there
        // against 256 ms on b.
        let (mut short, on_a) = a_busy_with(3, now);
        learn(&mut short, &on_a, 1_000, 400);
        assert_eq!(choice(&mut short, &prompt(4, 0), &none, now), GO_TO_B);
        // Nothing cached anywhere: nothing to wait for.
        let fresh = Route {
            prefix: vec![99, 98],
            ..Route::default()
        };
        assert_eq!(choice(&mut ledger, &fresh, &none, now), GO_TO_B);
        let explained = ledger.explain(&prompt(42, 0), now);
        assert_eq!(explained.choice.map(|a| a.port()), Some(2));
        assert_eq!(explained.waits_for.map(|a| a.port()), Some(1));
    }

    #[test]
    fn a_popular_prefix_spreads_once_its_queue_costs_more_than_a_prefill() {
        let now = Instant::now();
        let (mut ledger, on_a) = a_busy_with(40, now);
        learn(&mut ledger, &on_a, 1_000, 400);
        let route = prompt(42, 0);
        // Going costs 2,688 ms; waiting 128 ms plus 400 ms per request
        // served first: the sixth held would wait 2,528 ms, the seventh
        // 2,928 ms.
        let mut waits = Waits::default();
        let mut held = 0;
        while choice(&mut ledger, &route, &waits, now) == HOLD_FOR_A {
            waits.add(on_a.endpoint);
            held += 1;
            assert!(held < 100, "never spreads");
        }
        assert_eq!(held, 6);
        assert_eq!(waits.ahead(on_a.endpoint), 6);
        // The engine's own queue counts as requests served first.
        let mut busy_report = report("a", "127.0.0.1:1", 1);
        busy_report.requests_waiting = 6;
        ledger.apply_report(busy_report, on_a.addr, now);
        assert_eq!(choice(&mut ledger, &route, &Waits::default(), now), GO_TO_B);
    }

    #[test]
    fn a_spill_waits_one_percent_of_its_prefill_then_goes() {
        let now = Instant::now();
        // As `a_busy_with`, on a balancer alone in the fleet (a session's
        // first turn is placed by score, not at its rendezvous home).
        let mut ledger = EndpointLedger::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let addr = format!("127.0.0.1:{port}");
            let mut r = report(id, &addr, 1);
            r.balancers = Some(1);
            ledger.apply_report(r, addr.parse().unwrap(), now);
        }
        let Pick::Lease(on_a) = ledger.pick(&prompt(40, 0), now, None) else {
            panic!("a free endpoint takes it");
        };
        assert_eq!(on_a.addr.port(), 1);
        learn(&mut ledger, &on_a, 1_000, 400);
        // Six held for a before it: waiting (2,928 ms) costs more than
        // prefilling its 2,688 tokens on b.
        let mut waits = Waits::default();
        for _ in 0..6 {
            waits.add(on_a.endpoint);
        }
        let keyless = prompt(42, 0);
        let mut turn = prompt(42, 0);
        turn.session = Some(7);
        let not_yet = Holding {
            waits: &waits,
            may_spill: false,
        };
        let over = Holding {
            waits: &waits,
            may_spill: true,
        };
        // Either waits 1 % of that prefill first, counted as waiting for a
        // meanwhile; then it goes.
        for route in [&keyless, &turn] {
            assert_eq!(
                ledger.choose(route, now, Some(not_yet)),
                super::super::Choice::Delay(Duration::from_micros(26_880), on_a.endpoint)
            );
            assert!(matches!(
                ledger.choose(route, now, Some(over)),
                super::super::Choice::Endpoint(id) if id != on_a.endpoint
            ));
        }
    }

    #[test]
    fn the_rates_are_each_endpoints_own() {
        let now = Instant::now();
        let (mut ledger, on_a) = a_busy_with(40, now);
        learn(&mut ledger, &on_a, 1_000, 400);
        // b prefills 20 times as fast (0.05 ms per token): 131 ms for all
        // but its first block beats any wait on a.
        let Pick::Lease(on_b) = ledger.pick(&prompt(1, 0), now, None) else {
            panic!("b takes it");
        };
        learn(&mut ledger, &on_b, 50, 400);
        ledger.release(on_b, now);
        assert_eq!(
            choice(&mut ledger, &prompt(42, 0), &Waits::default(), now),
            GO_TO_B
        );
        // A slow engine is not waited for either: a, at 10 s per request,
        // is later than b's prefill at the default rate.
        let (mut slow, on_a) = a_busy_with(40, now);
        learn(&mut slow, &on_a, 1_000, 10_000);
        assert_eq!(
            choice(&mut slow, &prompt(42, 0), &Waits::default(), now),
            GO_TO_B
        );
    }

    #[test]
    fn a_sessions_endpoint_counts_its_conversation_as_cached() {
        let now = Instant::now();
        let (mut ledger, on_a) = a_busy_with(0, now);
        ledger.bind_session(7, on_a.addr, now);
        let turn = Route {
            session: Some(7),
            ..prompt(0, 3_000)
        };
        // 1,000 ms for a's slot (the default service time) against 3,000
        // ms of prefill on b.
        assert_eq!(
            choice(&mut ledger, &turn, &Waits::default(), now),
            HOLD_FOR_A
        );
        let short = Route {
            session: Some(7),
            ..prompt(0, 500)
        };
        assert_eq!(choice(&mut ledger, &short, &Waits::default(), now), GO_TO_B);
    }
}
