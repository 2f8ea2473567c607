//! Each endpoint's KV-cache events, as `/metrics` shows them: the blocks
//! its engine holds per medium, the events its agent applied, the gaps,
//! replays, resyncs, restarts and skipped frames it counted, whether its
//! blocks stand for the whole cache, and how old the last batch is
//! ([`flowgate::protocol::KvEventsReport`]). Refreshed from the snapshot
//! at scrape time; only endpoints whose agent follows events have them.

use prometheus::{GaugeVec, IntGaugeVec, Opts, Registry};

use super::family::{endpoint_labels, register};
use flowgate::EndpointSnapshot;

pub struct KvEventMetrics {
    blocks: IntGaugeVec,
    counts: IntGaugeVec,
    whole: IntGaugeVec,
    age: GaugeVec,
}

impl KvEventMetrics {
    pub fn new(registry: &Registry) -> Self {
        let ep = &["endpoint", "agent"];
        KvEventMetrics {
            blocks: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_blocks",
                        "Blocks the engine holds by its KV-cache events, per medium (gpu, cpu), \
                         as its agent reported",
                    ),
                    &["endpoint", "agent", "medium"],
                ),
            ),
            counts: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_events",
                        "Since the endpoint's agent started: batches and events applied, gaps \
                         seen, replays asked, resyncs (gaps no replay covered), engine restarts, \
                         frames and events skipped",
                    ),
                    &["endpoint", "agent", "kind"],
                ),
            ),
            whole: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_events_whole",
                        "1 when the engine's blocks stand for its whole cache (0 after lost \
                         events, until its cache turned over): placement routes on them",
                    ),
                    ep,
                ),
            ),
            age: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_events_age_seconds",
                        "Age of the engine's last event batch, as its agent reported",
                    ),
                    ep,
                ),
            ),
        }
    }

    /// Resets every series and sets those of the endpoints known now.
    pub fn refresh(&self, endpoints: &[EndpointSnapshot]) {
        for g in [&self.blocks, &self.counts, &self.whole] {
            g.reset();
        }
        self.age.reset();
        for e in endpoints {
            let Some(k) = e.agent.as_ref().and_then(|r| r.kv_events) else {
                continue;
            };
            let (endpoint, agent, _) = endpoint_labels(e);
            let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            for (medium, blocks) in [("gpu", k.blocks_gpu), ("cpu", k.blocks_cpu)] {
                self.blocks
                    .with_label_values(&[&endpoint, agent, medium])
                    .set(n(blocks));
            }
            for (kind, count) in [
                ("batches", k.batches),
                ("events", k.events),
                ("gaps", k.gaps),
                ("replays", k.replays),
                ("resyncs", k.resyncs),
                ("restarts", k.restarts),
                ("skipped", k.skipped),
            ] {
                self.counts
                    .with_label_values(&[&endpoint, agent, kind])
                    .set(n(count));
            }
            self.whole
                .with_label_values(&[&endpoint, agent])
                .set(i64::from(k.whole));
            if let Some(ms) = k.last_batch_ms_ago {
                self.age
                    .with_label_values(&[&endpoint, agent])
                    .set(ms as f64 / 1000.0);
            }
        }
    }
}
