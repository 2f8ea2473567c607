//! A request's trace at the proxy's hooks ([`crate::observe::traces`]):
//! begun with the request, its admission, its wait and the endpoint
//! chosen recorded as they end, its context sent upstream, and ended with
//! the request. Nothing here runs when traces are off.

use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use pingora_core::Result;
use pingora_proxy::Session;

use super::{Inference, RequestCtx};
use crate::observe::traces::Traces;

impl Inference {
    /// Begins the request's trace, under the client's `traceparent`.
    pub(super) fn trace_begin(&self, session: &Session, ctx: &mut RequestCtx) {
        if let Some(traces) = &self.traces {
            let req = session.req_header();
            ctx.trace = Some(Box::new(traces.begin(
                &req.headers,
                req.method.as_str(),
                req.uri.path(),
            )));
        }
    }

    /// The request was admitted (its facts read, its quotas passed).
    pub(super) fn trace_admitted(&self, ctx: &mut RequestCtx) {
        let Some((traces, trace)) = self.recording(ctx) else {
            return;
        };
        let mut attributes = vec![
            KeyValue::new("flowgate.model", ctx.facts.model.clone()),
            KeyValue::new("flowgate.fairness_id", tenant(ctx)),
            KeyValue::new("flowgate.priority", i64::from(ctx.facts.priority)),
            KeyValue::new(
                "flowgate.estimated_prompt_tokens",
                ctx.facts.tokens.prompt as i64,
            ),
        ];
        if let Some(s) = ctx.facts.session {
            attributes.push(KeyValue::new("flowgate.session", format!("{s:016x}")));
        }
        trace.child(traces, "admission", ctx.start, Instant::now(), attributes);
        ctx.waiting_ahead = self.door.gate.buffered();
    }

    /// The request got its slot after waiting `waited`: its wait in flow
    /// control, and the endpoint chosen with its score.
    pub(super) fn trace_bound(&self, ctx: &RequestCtx, waited: Duration) {
        let Some((traces, trace)) = self.recording(ctx) else {
            return;
        };
        let now = Instant::now();
        trace.child(
            traces,
            "queue.wait",
            now.checked_sub(waited).unwrap_or(now),
            now,
            vec![
                KeyValue::new("flowgate.fairness_id", tenant(ctx)),
                KeyValue::new("flowgate.priority", i64::from(ctx.facts.priority)),
                KeyValue::new("flowgate.queue.waiting_ahead", ctx.waiting_ahead as i64),
                KeyValue::new("flowgate.queue.waited_ms", waited.as_secs_f64() * 1000.0),
            ],
        );
        let Some(addr) = ctx.upstream else {
            return;
        };
        let mut attributes = vec![KeyValue::new("flowgate.endpoint", addr.to_string())];
        if let Some(meta) = &ctx.meta {
            let x = self.door.gate.explain(&meta.route);
            if let Some(winner) = x.candidates.iter().find(|c| c.addr == addr) {
                attributes.push(KeyValue::new("flowgate.score", winner.score));
                attributes.push(KeyValue::new(
                    "flowgate.prefix_matched_blocks",
                    winner.prefix_matched as i64,
                ));
                attributes.push(KeyValue::new(
                    "flowgate.prefix_source",
                    winner.prefix_source,
                ));
            }
            attributes.push(KeyValue::new(
                "flowgate.candidates",
                x.candidates.len() as i64,
            ));
            attributes.push(KeyValue::new(
                "flowgate.session_bound",
                x.session_endpoint == Some(addr),
            ));
        }
        trace.child(traces, "endpoint.choice", now, now, attributes);
    }

    /// The call to the engine begins: its trace context goes with it.
    pub(super) fn trace_upstream(
        &self,
        upstream_request: &mut pingora_http::RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let (Some(traces), Some(trace)) = (&self.traces, &mut ctx.trace) else {
            return Ok(());
        };
        for (name, value) in trace.begin_upstream(traces, ctx.upstream) {
            upstream_request.insert_header(name, value)?;
        }
        Ok(())
    }

    /// The request is over with `status`.
    pub(super) fn trace_end(&self, ctx: &mut RequestCtx, status: u16, reason: &'static str) {
        let Some(trace) = ctx.trace.take() else {
            return;
        };
        let mut attributes = vec![
            KeyValue::new("flowgate.request_id", ctx.request_id.as_str().to_owned()),
            KeyValue::new("flowgate.retries", i64::from(ctx.retry.done)),
        ];
        if !reason.is_empty() {
            attributes.push(KeyValue::new("flowgate.reason", reason));
        }
        if let Some(m) = ctx.facts.served_model.as_deref() {
            attributes.push(KeyValue::new("flowgate.served_model", m.to_string()));
        }
        trace.end(status, ctx.meter.first_byte_at(), attributes);
    }

    /// The traces and the request's trace, when it is kept (sampled).
    fn recording<'a>(
        &'a self,
        ctx: &'a RequestCtx,
    ) -> Option<(&'a Traces, &'a crate::observe::traces::RequestTrace)> {
        let traces = self.traces.as_deref()?;
        let trace = ctx.trace.as_deref().filter(|t| t.is_recording())?;
        Some((traces, trace))
    }
}

fn tenant(ctx: &RequestCtx) -> String {
    ctx.facts.fairness_id.as_deref().unwrap_or("").to_string()
}
