//! Stage 3, patience: wait for a busy endpoint, or go.
//!
//! When a request could go now (stage 2 found an endpoint that takes it)
//! but a saturated endpoint holds more of its prompt, its session or its
//! LoRA adapter, the request waits for that endpoint exactly while waiting
//! is predicted to be quicker than going:
//!
//! - going costs the prefill of what the free endpoint does not cache:
//!   uncached tokens × its prefill time per token (plus an adapter load
//!   where its adapter is not resident);
//! - waiting costs the wait for a slot there ([`super::load::Load::wait_ms`]:
//!   the requests before it, held for it in this dispatch pass, queued for
//!   it by their sessions and in its engine's queue, and foreign work),
//!   plus the prefill of what it does not cache (nothing, for the
//!   endpoint a session's conversation is on, whose wait is weighed
//!   [`SESSION_WAIT_MARGIN_TURNS`] turn at a slot long).
//!
//! Every rate is the endpoint's own, learned from its answers
//! ([`crate::endpoint::CostModel`]). So a long conversation waits for its
//! server, a short prompt never does, and a popular prefix spreads to a
//! second server once the requests queued for the first cost more than
//! one more prefill. `scheduling.affinityHold` only bounds the wait, in
//! case the estimates are wrong; the dispatcher owns that clock. (Counting
//! what a request already waited against the prefill, the ski-rental
//! bound, was tried: it moved conversations away from their cache under
//! load and cost throughput; see BENCHMARKS.md.)
//!
//! A conversation's first turn (a turn of a session its client named that
//! no endpoint serves yet) starts the conversation where it goes: its
//! later turns wait there. So it does not wait for a busy endpoint's cache
//! where going evens out the work ([`super::evening`]'s rule: that one
//! carries a request per slot more than the mean, a free one a request
//! fewer): it spills. Weighing only its own turn, the 32 queued first turns
//! of 64 conversations starting at once on four servers of 8 slots waited
//! for their groups' prompts and put 24 conversations on one server and 8
//! on another, whose turns then waited 570 and 40 ms for about 10 s (issue
//! 34's workload); with the rule 16 to 18 first turns a server in the
//! first 5 s (BENCHMARKS.md, session 41).
//!
//! Going while a saturated endpoint holds more of the prompt is a spill. A
//! spill waits first [`SPILL_PATIENCE`] of the prefill it will pay
//! ([`spill_delay`]); then the dispatcher lets it pass the requests that
//! wait for the free endpoint only where that evens out the work
//! ([`super::evening`]).

use std::time::{Duration, Instant};

use super::evening::Balance;
use super::load::{Load, Waits};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};

/// Bytes of prompt text per token assumed to turn cached blocks into
/// tokens (a prefix block is `block_bytes` of text): the usual ratio of
/// English text and code in BPE vocabularies; a route that carries a
/// token estimate uses it instead where it is larger.
const BYTES_PER_TOKEN: u64 = 4;

/// Of a spill's predicted cold prefill, the share it waits first (1 %):
/// long enough for the other groups' first turns of a burst that starts at
/// once to take the free slot (placed one by one as they came, the first
/// group's spills took every free server before the others arrived, and
/// each then prefilled two or three groups' prompts cold), short against
/// the prefill itself.
const SPILL_PATIENCE: f64 = 0.01;

/// A conversation's turn weighs its wait for its own busy endpoint this
/// many turns at a slot ([`Load::turn_ms`]) longer than the predicted
/// mean. The turns ahead of it there are other conversations' turns,
/// whose answers and tool outputs vary in length, so that wait runs past
/// its mean more often than a prefill elsewhere runs past its own; with
/// conversations arriving at random (the open-loop sessions bench) its
/// TTFT p99 ×0.93 (1.63–1.67 s against 1.73–1.81 s, three runs each),
/// the closed-loop workloads unchanged (BENCHMARKS.md, session 36). Only
/// the session's endpoint: weighed the same, a prompt's other holders made
/// bursts of first turns prefill small groups twice.
pub(super) const SESSION_WAIT_MARGIN_TURNS: f64 = 1.0;

/// The longest spill delay: a prefill predicted absurdly long (a wrong
/// rate) still goes within a minute (and within the affinity hold, which
/// bounds every clock of the dispatcher's).
const SPILL_DELAY_MAX_MS: f64 = 60_000.0;

/// What stage 3 says of a request some endpoint takes now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum WaitOrGo {
    /// Wait for saturated endpoint `at`: its first token predicted sooner
    /// there than on the free one (or a hard session's endpoint).
    Wait { at: EndpointId },
    /// Go, although a saturated endpoint holds more of its prompt (the
    /// quickest of those, `holder`): a spill, which prefills `cold_ms`
    /// again.
    Spill { cold_ms: f64, holder: EndpointId },
    /// Go: no saturated endpoint would serve it sooner by its cache.
    Go,
}

/// How long a request waits before it spills: [`SPILL_PATIENCE`] of the
/// prefill it pays cold, at most [`SPILL_DELAY_MAX_MS`].
pub(crate) fn spill_delay(cold_ms: f64) -> Duration {
    Duration::from_secs_f64((cold_ms * SPILL_PATIENCE).clamp(0.0, SPILL_DELAY_MAX_MS) / 1_000.0)
}

/// The route's prompt tokens: its estimate, and at least what its prefix
/// blocks hold (a route may carry no estimate).
pub(crate) fn prompt_tokens(fleet: &EndpointLedger, route: &Route) -> u64 {
    let block_bytes = fleet.scheduling().prefix.block_bytes as u64;
    route
        .tokens
        .prompt
        .max(route.prefix.len() as u64 * block_bytes / BYTES_PER_TOKEN)
}

/// Whether placement weighs the route's cached prompt blocks: the prefix
/// scorer is on and the prompt has blocks.
fn prefix_counts(fleet: &EndpointLedger, route: &Route) -> bool {
    fleet.scheduling().scorers.prefix_cache > 0.0 && !route.prefix.is_empty()
}

/// Leading blocks of the route's prompt `e` holds, as placement counts
/// them ([`prefix_counts`]: none when it does not weigh them).
pub(crate) fn matched_blocks(fleet: &EndpointLedger, route: &Route, e: &Endpoint) -> usize {
    if prefix_counts(fleet, route) {
        e.prefix_matched(route)
    } else {
        0
    }
}

/// Tokens of the route's prompt an endpoint holding `matched` of its
/// leading blocks has cached.
pub(crate) fn cached_tokens(fleet: &EndpointLedger, route: &Route, matched: usize) -> u64 {
    let block_bytes = fleet.scheduling().prefix.block_bytes as u64;
    (matched as u64 * block_bytes / BYTES_PER_TOKEN).min(prompt_tokens(fleet, route))
}

/// Time to a first token on saturated endpoint `e`, as the rule weighs
/// it, of a request whose prompt has `cached` of its `prompt` tokens
/// cached there: its wait for a slot behind the requests `waits` holds
/// for it, `margin_turns` turns at a slot longer than predicted; its
/// prefill; `load_ms`, its adapter's load there.
fn busy_ttft_ms(
    e: &Endpoint,
    waits: &Waits,
    margin_turns: f64,
    prompt: u64,
    cached: u64,
    load_ms: f64,
) -> f64 {
    let load = Load::of(e, waits);
    let service_ms = e.service_ms();
    load.wait_ms(service_ms)
        + margin_turns * load.turn_ms(service_ms)
        + e.predicted_prefill_ms(prompt - cached)
        + load_ms
}

/// Stage 3 (module docs): the saturated endpoint `route` should wait for
/// rather than go to `go`, which takes it now, if any. `bound`: the
/// saturated endpoint its session is on (its conversation counts as cached
/// there; in hard mode it is always waited for). `wanted`: its adapter.
pub(crate) fn wait_or_go(
    fleet: &EndpointLedger,
    route: &Route,
    go: EndpointId,
    bound: Option<EndpointId>,
    waits: &Waits,
    wanted: Option<&Wanted>,
    now: Instant,
) -> WaitOrGo {
    if let Some(id) = bound.filter(|_| route.waits_hard(fleet.scheduling().sessions.hard)) {
        return WaitOrGo::Wait { at: id };
    }
    let Some(go_endpoint) = fleet.endpoint(go) else {
        return WaitOrGo::Go;
    };
    let prompt = prompt_tokens(fleet, route);
    let scored = prefix_counts(fleet, route);
    let matched = |e: &Endpoint| matched_blocks(fleet, route, e);
    let go_matched = matched(go_endpoint);
    // A request for a LoRA adapter waits for its load where the adapter
    // is not resident.
    let load_ms = |e: &Endpoint| match wanted {
        Some(w) if e.residency(&w.name).loads() => e.predicted_adapter_load_ms(),
        _ => 0.0,
    };
    let go_ms = go_endpoint.predicted_prefill_ms(prompt - cached_tokens(fleet, route, go_matched))
        + load_ms(go_endpoint);
    if go_ms <= 0.0 {
        return WaitOrGo::Go;
    }
    // A conversation's first turn (module docs): where it goes, its later
    // turns wait.
    let starts = bound.is_none() && route.session.is_some() && !route.session_by_prompt;
    let mut balance: Option<Balance> = None;
    // The quickest saturated endpoint, if quicker than going.
    let mut best: Option<(f64, EndpointId)> = None;
    let mut consider = |e: &Endpoint, cached: u64| {
        let margin = if Some(e.id) == bound {
            SESSION_WAIT_MARGIN_TURNS
        } else {
            0.0
        };
        let evens_out = starts && {
            let balance =
                balance.get_or_insert_with(|| Balance::of(fleet, route, waits, 0, None, now));
            balance.moving_evens_out(&Load::of(e, waits))
        };
        let ms = if evens_out {
            // Not waited for: still the holder a spill leaves.
            f64::INFINITY
        } else {
            busy_ttft_ms(e, waits, margin, prompt, cached, load_ms(e))
        };
        if best.is_none_or(|b| (ms, e.id) < b) {
            best = Some((ms, e.id));
        }
    };
    if let Some(e) = bound
        .and_then(|id| fleet.endpoint(id))
        .filter(|e| e.keeps_conversations())
    {
        consider(e, prompt);
    }
    if scored {
        busy_holding_more(fleet, route, go_matched, now, |e, matched| {
            consider(e, cached_tokens(fleet, route, matched));
        });
    }
    if let Some(w) = wanted {
        busy_holding_adapter(fleet, route, w, go_endpoint, now, |e| {
            consider(e, cached_tokens(fleet, route, matched(e)));
        });
    }
    match best {
        Some((wait_ms, at)) if wait_ms < go_ms => WaitOrGo::Wait { at },
        Some((_, holder)) => WaitOrGo::Spill {
            cold_ms: go_ms,
            holder,
        },
        None => WaitOrGo::Go,
    }
}

/// Calls `f` with each saturated (eligible) endpoint that holds more than
/// `than` of the route's leading blocks, and how many it holds.
fn busy_holding_more(
    fleet: &EndpointLedger,
    route: &Route,
    than: usize,
    now: Instant,
    mut f: impl FnMut(&Endpoint, usize),
) {
    let Some(next_block) = route.prefix.get(than) else {
        return;
    };
    let config = fleet.saturation();
    let busy_here =
        |e: &&Endpoint| e.fits(route) && e.eligible(now) && !e.takes(route, now, config);
    let mut look = |e: &Endpoint| {
        let matched = e.prefix_matched(route);
        if matched > than {
            f(e, matched);
        }
    };
    // The engines with events say what they hold, whatever this
    // balancer's own index guesses (another balancer or a client may have
    // filled them): each that holds some of the prompt is looked at, and
    // only the others by the guess.
    let engines = route.engine_held.as_deref();
    let by_guess = |e: &&Endpoint| engines.is_none_or(|h| h.share(e.addr).is_none());
    if let Some(held) = engines {
        (held.by_endpoint.iter())
            .filter(|(_, m)| m.gpu + m.cpu > 0)
            .filter_map(|(addr, _)| fleet.endpoint_at(*addr))
            .filter(busy_here)
            .for_each(&mut look);
    }
    // Whoever holds more leading blocks holds the block right after the
    // first `than`: its holders are every endpoint to look at. When a
    // prompt many endpoints saw has more holders than the route has
    // endpoints, those are fewer.
    let holders = fleet.holders_of(*next_block);
    let serving = match &route.subset {
        Some(s) => s.len(),
        None => fleet.lane_len(route.model.as_deref()),
    };
    if holders.len() <= serving {
        holders
            .iter()
            .filter_map(|id| fleet.endpoint(*id))
            .filter(busy_here)
            .filter(by_guess)
            .for_each(&mut look);
    } else {
        (fleet.serving(route))
            .filter(busy_here)
            .filter(by_guess)
            .for_each(&mut look);
    }
}

/// Of the saturated endpoints serving `route`, those where its adapter is
/// resident while `go` (which takes it now) would load it: each is called
/// with `f`.
fn busy_holding_adapter(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: &Wanted,
    go: &Endpoint,
    now: Instant,
    mut f: impl FnMut(&Endpoint),
) {
    if !go.residency(&wanted.name).loads() {
        return;
    }
    let config = fleet.saturation();
    fleet
        .serving(route)
        .filter(|e| e.eligible(now) && !e.takes(route, now, config))
        .filter(|e| !e.residency(&wanted.name).loads())
        .for_each(&mut f);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::endpoint::{Lease, Timing, COST_WINDOW};
    use crate::placement::{explain, pick, place, Outcome, Pass, Pick};
    use crate::protocol::tests::report;
    use crate::tokens::TokenEstimate;

    /// Endpoints `a` (port 1) and `b` (port 2), one slot each; `a` is busy
    /// with a prompt of `cached` blocks (64 tokens each), so it holds them.
    fn a_busy_with(cached: u64, now: Instant) -> (EndpointLedger, Lease) {
        busy_a(cached, None, now)
    }

    /// As [`a_busy_with`], on a balancer alone in the fleet (a session's
    /// first turn is placed by score, not at its rendezvous home).
    fn alone_a_busy_with(cached: u64, now: Instant) -> (EndpointLedger, Lease) {
        busy_a(cached, Some(1), now)
    }

    fn busy_a(cached: u64, balancers: Option<u32>, now: Instant) -> (EndpointLedger, Lease) {
        let mut ledger = EndpointLedger::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let addr = format!("127.0.0.1:{port}");
            let mut r = report(id, &addr, 1);
            r.balancers = balancers;
            ledger.apply_report(r, addr.parse().unwrap(), now);
        }
        let Pick::Lease(on_a) = pick(&mut ledger, &prompt(cached, 0), now, None) else {
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
        for _ in 0..COST_WINDOW {
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
        let pass = Pass {
            waits,
            may_spill: true,
        };
        let port = |id| ledger.endpoint(id).unwrap().addr.port();
        match place(ledger, route, Some(pass), now).outcome {
            Outcome::Wait(id) => port(id) + 100,
            Outcome::Go(id) => port(id),
            Outcome::Delay(..) | Outcome::Busy | Outcome::Shed => 0,
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
        let explained = explain(&ledger, &prompt(42, 0), now);
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
    fn a_conversations_first_turn_spills_where_its_going_evens_out_the_work() {
        let now = Instant::now();
        let (mut ledger, on_a) = alone_a_busy_with(40, now);
        learn(&mut ledger, &on_a, 1_000, 400);
        let keyless = prompt(42, 0);
        let mut first = prompt(42, 0);
        first.session = Some(7);
        // Nothing held for a: it carries one request a slot, the mean is
        // a half; both wait for the cached prompt.
        let none = Waits::default();
        assert_eq!(choice(&mut ledger, &keyless, &none, now), HOLD_FOR_A);
        assert_eq!(choice(&mut ledger, &first, &none, now), HOLD_FOR_A);
        // One held for a: two there, the mean one, b one with the turn. A
        // keyless request still waits (928 against 2,688 ms); the first
        // turn of a conversation, whose later turns would wait on a, goes.
        let mut one = Waits::default();
        one.add(on_a.endpoint);
        assert_eq!(choice(&mut ledger, &keyless, &one, now), HOLD_FOR_A);
        assert_eq!(choice(&mut ledger, &first, &one, now), GO_TO_B);
        // Its conversation's next turn, bound to a, waits for a again.
        ledger.bind_session(7, on_a.addr, now);
        assert_eq!(choice(&mut ledger, &first, &one, now), HOLD_FOR_A);
    }

    #[test]
    fn a_spill_waits_one_percent_of_its_prefill_then_goes() {
        let now = Instant::now();
        let (mut ledger, on_a) = alone_a_busy_with(40, now);
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
        let not_yet = Pass {
            waits: &waits,
            may_spill: false,
        };
        let over = Pass {
            waits: &waits,
            may_spill: true,
        };
        // Either waits 1 % of that prefill first, counted as waiting for a
        // meanwhile; then it goes.
        for route in [&keyless, &turn] {
            assert_eq!(
                place(&ledger, route, Some(not_yet), now).outcome,
                Outcome::Delay(Duration::from_micros(26_880), on_a.endpoint)
            );
            assert!(matches!(
                place(&ledger, route, Some(over), now).outcome,
                Outcome::Go(id) if id != on_a.endpoint
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
        let Pick::Lease(on_b) = pick(&mut ledger, &prompt(1, 0), now, None) else {
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
    fn a_sessions_turn_weighs_its_wait_one_turn_long() {
        let now = Instant::now();
        let (mut ledger, on_a) = a_busy_with(0, now);
        ledger.bind_session(7, on_a.addr, now);
        // 1,000 ms for a's one slot (the default service time), weighed
        // 2,000 ms: a turn of 1,800 tokens (1,800 ms of prefill on b)
        // goes, one of 2,200 waits.
        let turn = |tokens| Route {
            session: Some(7),
            ..prompt(0, tokens)
        };
        assert_eq!(
            choice(&mut ledger, &turn(1_800), &Waits::default(), now),
            GO_TO_B
        );
        assert_eq!(
            choice(&mut ledger, &turn(2_200), &Waits::default(), now),
            HOLD_FOR_A
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
