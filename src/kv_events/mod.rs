//! What the engines really hold in their KV caches, from their own events.
//!
//! vLLM and SGLang publish every block they store and evict (ZeroMQ,
//! msgpack). The agent beside each engine subscribes, decodes each batch
//! ([`wire`]), keys every stored block by its tokens the way the balancer
//! can key a request's prompt ([`key`]), and keeps the engine's blocks in
//! an index that applies the batches in order, replays gaps and knows
//! when it lost events ([`index`]); the union over an endpoint's engines
//! reaches each balancer as deltas since the version it holds
//! ([`holdings`]), which keeps a copy per endpoint ([`copy`]) and routes
//! on the blocks each engine holds instead of its own guess.
//!
//! Everything here is pure: the sockets are the agent's.

pub mod copy;
pub mod holdings;
pub mod index;
pub mod key;
pub mod prompt;
pub mod wire;

pub use copy::{BlocksCopy, Matched};
pub use holdings::{BlocksUpdate, BlocksVersion, Holdings};
pub use index::{Change, EngineIndex, IndexStats, Order};
pub use key::{BlockKey, KEY_VERSION};
pub use prompt::EngineHeld;
pub use wire::{decode_batch, Batch, EngineHash, Event, FrameError, Medium, Skipped, Stored};

#[cfg(test)]
mod tests;
