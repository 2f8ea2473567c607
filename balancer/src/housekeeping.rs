//! Background work: dropping agents that stopped reporting, ending affinity
//! holds on time, calling the scale-up webhook, taking the dashboard's
//! history readings, and leaving the process as soon as a graceful shutdown
//! has nothing left to finish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::{ExecutionPhase, Server, ShutdownWatch};
use pingora_core::services::background::BackgroundService;
use tracing::{info, warn};

use crate::gate::FleetGate;
use crate::observe::traces::Traces;
use crate::scaleup::ScaleUpWebhook;

/// Longest pause between two rounds.
const MAX_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

pub struct Housekeeping {
    pub shared: Arc<FleetGate>,
    pub scale_up: Option<ScaleUpWebhook>,
}

#[async_trait]
impl BackgroundService for Housekeeping {
    async fn start(&self, _shutdown: ShutdownWatch) {
        // Runs on through a graceful shutdown: the requests it drains still
        // need stale agents dropped and affinity holds ended.
        loop {
            let (dropped, next) = self.shared.housekeeping();
            for agent in dropped {
                warn!(
                    agent,
                    "agent missed 3 reports: dropped (in-flight requests finish)"
                );
            }
            if let Some(hook) = &self.scale_up {
                hook.notify(&self.shared.unserved_demand());
            }
            let now = Instant::now();
            if self.shared.history.due(now) {
                self.shared
                    .history
                    .record(now, self.shared.metrics.tallies());
            }
            let wake = next
                .map_or(now + MAX_SWEEP_INTERVAL, |t| {
                    t.min(now + MAX_SWEEP_INTERVAL)
                })
                .max(now + Duration::from_millis(1));
            tokio::select! {
                () = tokio::time::sleep_until(wake.into()) => {}
                () = self.shared.timers_changed() => {}
            }
        }
    }
}

/// On SIGTERM Pingora stops accepting connections, then waits out the whole
/// grace period before it exits. This watcher exits as soon as no request is
/// under way (from its head on: one still sending its body counts), buffered
/// or in flight, so a drained balancer stops at once and a busy one gets up
/// to the grace period.
pub fn exit_when_drained(
    server: &Server,
    shared: Arc<FleetGate>,
    grace: Duration,
    traces: Option<Arc<Traces>>,
) {
    let mut phases = server.watch_execution_phase();
    std::thread::Builder::new()
        .name("shutdown-watch".into())
        .spawn(move || loop {
            match phases.blocking_recv() {
                Ok(ExecutionPhase::GracefulTerminate) => {
                    shared.begin_shutdown();
                    info!(
                        grace_s = grace.as_secs(),
                        "SIGTERM: draining in-flight requests"
                    );
                    loop {
                        if shared.is_drained() {
                            info!("drained: exiting");
                            if let Some(traces) = &traces {
                                // The last spans go before the process.
                                traces.shutdown();
                            }
                            std::process::exit(0);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        })
        .expect("spawn shutdown watcher thread");
}
