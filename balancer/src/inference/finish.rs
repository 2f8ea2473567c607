//! The end of a request at the proxy: whose fault a failure was, what it
//! spent settled in the order every door uses ([`Served::finish`]: usage,
//! quotas, token-fair charge, then the slot), its outcome counted, and its
//! access log line written.
//!
//! [`Served::finish`]: crate::gate::Served::finish

use flowgate::blame;
use flowgate::session::{self, SessionLabel};
use pingora_core::{Error, ErrorSource};
use pingora_proxy::Session;
use tracing::info;

use super::context::Ending;
use super::{Inference, RequestCtx};
use crate::connection;
use crate::gate::{AnswerEnd, SlotEnd};

impl Inference {
    /// A request is over (Pingora's `logging` hook): settles what it
    /// spent and logs it.
    pub(super) fn finish(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        if ctx
            .parked
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            // Not over: it waits outside the proxy and comes back.
            return;
        }
        connection::request_done(session);
        // A retry that never got an answer cannot clear its suspect.
        self.blame_suspect(ctx);
        if ctx.answer.rejected && e.is_none() && !blame::is_engine_error(&ctx.answer.error_body) {
            // JSON, but not an engine's error object: the endpoint's.
            self.record_outcome(ctx, false);
        }
        let said = ctx.meter.said();
        let usage = said.usage;
        let client_left = e.is_some_and(|e| e.esource() == &ErrorSource::Downstream);
        let predicted_ttft_ms = ctx
            .served
            .as_ref()
            .and_then(|s| s.lease())
            .and_then(|l| l.ttft_p90_ms());
        if let Some(served) = ctx.served.take() {
            served.finish(AnswerEnd {
                sent: ctx.answer.status.is_some(),
                // What the answer spent (a stream cut short: what was sent).
                said: (ctx.meter).spent(usage, ctx.facts.tokens.prompt, ctx.answer.status),
                // Only a whole, successful answer shows the engine's speed:
                // an error comes back fast, a client that left cut the
                // answer short.
                timing: (ctx.answer.status.is_some_and(|s| s < 400) && !client_left)
                    .then(|| {
                        (ctx.meter).timing(&said, ctx.answer.sent_at, std::time::Instant::now())
                    })
                    .flatten(),
                // The client left before its answer ended: the engine may
                // still be working on it, so its slot is not free yet.
                slot: if client_left {
                    SlotEnd::Orphaned {
                        streamed: ctx.facts.stream || ctx.meter.streaming,
                    }
                } else {
                    SlotEnd::Free
                },
            });
        }
        if ctx.answer.status.is_some_and(|s| s < 400) {
            self.bind_response(ctx);
            self.share_session(ctx);
        }
        let status = session
            .response_written()
            .map(|h| h.status.as_u16())
            .unwrap_or(if ctx.ending == Ending::ClientGone || e.is_some() {
                499
            } else {
                0
            });
        // An error with no other ending: the connection to the client
        // broke.
        let reason = match ctx.ending {
            Ending::Proxied if e.is_some() => Ending::ClientGone,
            ending => ending,
        }
        .as_str();
        self.trace_end(ctx, status, reason);
        let ttft = ctx.meter.time_to_first_token(ctx.start);
        if ctx.inference {
            self.door.gate.metrics.record_outcome(status, reason);
            if ctx.answer.status.is_some_and(|s| s < 400) {
                if let (Some(u), Some(model)) = (usage, ctx.facts.served_model.as_deref()) {
                    self.door
                        .gate
                        .learn_tokens(model, ctx.facts.prompt_bytes, u.prompt);
                }
                let tpot = ctx.meter.time_per_output_token(usage);
                let model = self.door.gate.model_label(
                    ctx.facts
                        .served_model
                        .as_deref()
                        .unwrap_or(&ctx.facts.model),
                );
                self.door.gate.metrics.answer(model, ttft, tpot, usage);
                if let Some(meta) = &ctx.meta {
                    self.door.gate.metrics.objectives.record(
                        model,
                        ctx.facts.fairness_id.as_deref().unwrap_or(""),
                        meta.route.objective,
                        ctx.meter.time_to_first_byte(ctx.start),
                        tpot,
                    );
                }
            }
        }
        let objective = ctx
            .meta
            .as_ref()
            .map(|m| m.route.objective)
            .unwrap_or_default();
        info!(
            target: "access",
            request_id = ctx.request_id.as_str(),
            method = %session.req_header().method,
            path = session.req_header().uri.path(),
            model = ctx.facts.model.as_str(),
            served_model = ctx.facts.served_model.as_deref().unwrap_or(""),
            fallback = ctx.facts.fallback.as_deref().unwrap_or(""),
            fairness_id = ctx.facts.fairness_id.as_deref().unwrap_or(""),
            priority = ctx.facts.priority,
            // Nothing to format for a request without a session.
            session = ctx.facts.session.map(|s| tracing::field::display(SessionLabel(Some(s)))),
            status,
            reason,
            upstream = ctx.upstream.map(|a| a.to_string()).unwrap_or_default(),
            retries = ctx.retry.done,
            wait_ms = ctx.waited.as_millis() as u64,
            ttft_ms = ttft.map(|t| t.as_millis() as u64),
            slo_ttft_ms = objective.ttft_ms,
            slo_tpot_ms = objective.tpot_ms,
            predicted_ttft_ms,
            estimated_prompt_tokens = ctx.facts.tokens.prompt,
            estimated_output_tokens = ctx.facts.tokens.output,
            prompt_tokens = usage.map(|u| u.prompt),
            completion_tokens = usage.map(|u| u.completion),
            cached_tokens = usage.map(|u| u.cached),
            duration_ms = ctx.start.elapsed().as_millis() as u64,
            error = e.map(|e| e.to_string()).unwrap_or_default(),
        );
    }

    /// A turn was served: the other balancers learn where its conversation
    /// went (its session, or for a keyless one this turn's prompt; the
    /// binding's idle time starts again).
    fn share_session(&self, ctx: &RequestCtx) {
        if let (Some(store), Some(key), Some(addr)) =
            (&self.door.session_store, ctx.facts.store_key, ctx.upstream)
        {
            store.record(key, addr);
        }
    }

    /// A Responses answer's id goes with the endpoint that gave it, so the
    /// turn that continues it (`previous_response_id`) goes there too.
    fn bind_response(&self, ctx: &RequestCtx) {
        let (Some(id), Some(addr), Some(tenant)) = (
            ctx.meter.response_id(),
            ctx.upstream,
            ctx.facts.fairness_id.as_deref(),
        ) else {
            return;
        };
        if let Some(key) = session::response_key(tenant, id) {
            self.door.gate.bind_session(key, addr);
        }
    }
}
