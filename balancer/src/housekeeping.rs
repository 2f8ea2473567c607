//! Background work: dropping agents that stopped reporting, ending affinity
//! holds on time, calling the scale-up webhook, taking the dashboard's
//! history readings, and leaving the process as soon as a graceful shutdown
//! has nothing left to finish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::{
    ExecutionPhase, Server, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch,
};
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

/// SIGTERM as a front load balancer needs it: readiness answers 503 at
/// once ([`FleetGate::begin_draining`]), requests are still accepted and
/// served for `drain_delay` (so the front stops sending before the port
/// closes), and only then is Pingora told to terminate gracefully (stop
/// listening, finish what is in flight and buffered: [`exit_when_drained`]).
/// SIGINT stops at once, also during the delay; SIGQUIT is Pingora's
/// graceful upgrade.
pub struct DrainFirst {
    pub shared: Arc<FleetGate>,
    pub drain_delay: Duration,
}

#[async_trait]
impl ShutdownSignalWatch for DrainFirst {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{signal, SignalKind};
        let mut quit = signal(SignalKind::quit()).expect("install SIGQUIT handler");
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        tokio::select! {
            _ = quit.recv() => return ShutdownSignal::GracefulUpgrade,
            _ = int.recv() => return ShutdownSignal::FastShutdown,
            _ = term.recv() => {}
        }
        self.shared.begin_draining();
        if !self.drain_delay.is_zero() {
            info!(
                drain_delay_ms = self.drain_delay.as_millis() as u64,
                "SIGTERM: not ready (503) from now on; still serving during the drain delay"
            );
            tokio::select! {
                () = tokio::time::sleep(self.drain_delay) => {}
                _ = int.recv() => return ShutdownSignal::FastShutdown,
            }
        }
        ShutdownSignal::GracefulTerminate
    }
}
