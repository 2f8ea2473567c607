//! The `agentic` workload: coding-agent conversations. Each is a ~4 KB
//! system prompt shared by its group, a ~1 KB first message of its own and
//! 8-12 turns, each appending the answer and 1-2 KB of tool output.
//!
//! Closed loop (the default), each of `--clients` clients holds one
//! conversation at a time and starts the next when it ends. Open loop
//! (`--conversation-rate`), conversations start at that rate whatever the
//! routers' speed (Poisson arrivals), each runs its turns one after the
//! other and ends: how many are open at once is up to the routers, as
//! under real traffic near saturation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{group_of, system_prompt, Rng, Sender};

/// One conversation: its key and what it has said so far.
pub struct Conversation {
    pub key: String,
    messages: Vec<Value>,
    turns_left: u64,
}

impl Conversation {
    /// A new conversation named `name` (its key also has a random part)
    /// over the system prompt of `group`.
    pub fn new(name: &str, group: usize, rng: &mut Rng) -> Self {
        let turns_left = 8 + rng.below(5);
        let key = format!("agent-{name}-{}", rng.below(1 << 32));
        let first = format!("Task {key}: {}", "fix the failing build step. ".repeat(37));
        Conversation {
            messages: vec![
                json!({"role": "system", "content": system_prompt(group, 80)}),
                json!({"role": "user", "content": first}),
            ],
            key,
            turns_left,
        }
    }

    /// The next turn's messages; `None` once the conversation is over.
    pub fn next_turn(&mut self) -> Option<Vec<Value>> {
        self.turns_left = self.turns_left.checked_sub(1)?;
        Some(self.messages.clone())
    }

    /// Its turn was answered (turn `n` of its client): the answer, then
    /// what the tool said, 1-2 KB.
    pub fn answered(&mut self, n: u64, rng: &mut Rng) {
        let tool = format!(
            "$ make test # {n}\n{}",
            "ok test_case passed in 3ms\n".repeat(40 + rng.below(40) as usize)
        );
        self.messages
            .push(json!({"role": "assistant", "content": "Running the tests."}));
        self.messages.push(json!({"role": "user", "content": tool}));
    }
}

/// Open loop: conversations start at `rate` a second (exponential gaps
/// from `seed`) until `until`, in groups as `clients` closed-loop clients
/// would hold them (`groups`), tenants in turn; returns once every
/// conversation has ended or stopped at `until`.
pub async fn open_loop(
    sender: Arc<Sender>,
    rate: f64,
    clients: usize,
    groups: Vec<usize>,
    seed: u64,
    until: Instant,
) {
    let mut arrivals = Rng(seed ^ 0xA5A5_5A5A_F00D_CAFE);
    let mut next = Instant::now();
    let mut conversations = Vec::new();
    for k in 0.. {
        if next >= until {
            break;
        }
        tokio::time::sleep_until(next.into()).await;
        let group = group_of(k % clients.max(1), &groups);
        let tenant = sender.tenant(k);
        let sender = Arc::clone(&sender);
        let mut rng = Rng((seed << 16) ^ ((k as u64 + 1) * 0x9E37_79B9));
        conversations.push(tokio::spawn(async move {
            let mut conversation = Conversation::new(&format!("open-{k}"), group, &mut rng);
            let mut n = 0;
            while Instant::now() < until {
                let Some(messages) = conversation.next_turn() else {
                    break;
                };
                n += 1;
                sender
                    .send(messages, &tenant, false, &conversation.key)
                    .await;
                conversation.answered(n, &mut rng);
            }
        }));
        // Exponential gap: -ln(U) / rate, U uniform in (0, 1].
        let u = (arrivals.below(1 << 53) + 1) as f64 / (1u64 << 53) as f64;
        next += Duration::from_secs_f64(-u.ln() / rate);
    }
    for c in conversations {
        let _ = c.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_runs_8_to_12_turns_each_longer_by_its_tool_output() {
        let mut rng = Rng(7);
        for k in 0..50 {
            let mut c = Conversation::new(&k.to_string(), k % 3, &mut rng);
            let mut turns = Vec::new();
            while let Some(turn) = c.next_turn() {
                turns.push(turn);
                c.answered(turns.len() as u64, &mut rng);
            }
            assert!((8..=12).contains(&turns.len()), "{} turns", turns.len());
            // Each turn re-sends the last one whole, then the answer and
            // 1-2 KB of tool output.
            for pair in turns.windows(2) {
                assert_eq!(pair[1][..pair[0].len()], pair[0][..]);
                assert_eq!(pair[1].len(), pair[0].len() + 2);
                let tool = pair[1].last().unwrap()["content"].as_str().unwrap();
                assert!(
                    (1_000..=2_200).contains(&tool.len()),
                    "{} bytes",
                    tool.len()
                );
            }
            assert!(c.next_turn().is_none(), "over stays over");
        }
    }
}
