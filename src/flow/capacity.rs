//! Capacity: making room for a newcomer when the whole buffer is full, by
//! evicting the newest request of the largest flow of a lower band.

use super::{FlowIdx, FlowQueues, Removed, Size, Ticket};

impl<T> FlowQueues<T> {
    /// Makes room for a request of `priority` and `size` under the global
    /// limits, evicting work of strictly lower priority when that suffices.
    /// `None` (and nothing evicted) when it cannot.
    pub(super) fn make_room(&mut self, priority: i32, size: Size) -> Option<Vec<Removed<T>>> {
        let Size { bytes, tokens } = size;
        let max_requests = self.config.max_requests;
        let max_bytes = self.config.max_bytes;
        let max_tokens = self.config.max_tokens.unwrap_or(u64::MAX);
        if max_requests == 0 || bytes > max_bytes || tokens > max_tokens {
            return None;
        }
        let excess_requests = (self.requests + 1).saturating_sub(max_requests);
        let excess_bytes = (self.bytes + bytes).saturating_sub(max_bytes);
        let excess_tokens = self
            .tokens
            .saturating_add(tokens)
            .saturating_sub(max_tokens);
        if excess_requests == 0 && excess_bytes == 0 && excess_tokens == 0 {
            return Some(Vec::new());
        }
        let (lower_requests, lower_bytes, lower_tokens) = self
            .bands
            .range(..priority)
            .fold((0, 0, 0), |(r, b, t), (_, band)| {
                (r + band.requests, b + band.bytes, t + band.tokens)
            });
        if lower_requests < excess_requests
            || lower_bytes < excess_bytes
            || lower_tokens < excess_tokens
        {
            return None;
        }
        let mut evicted = Vec::new();
        while self.requests + 1 > max_requests
            || self.bytes + bytes > max_bytes
            || self.tokens.saturating_add(tokens) > max_tokens
        {
            let victim = self.eviction_victim(priority)?;
            evicted.push(self.cancel(victim).expect("victim is queued"));
        }
        Some(evicted)
    }

    /// The newest request (last in its flow's order) of the largest flow of
    /// the lowest band below `priority`.
    fn eviction_victim(&self, priority: i32) -> Option<Ticket> {
        let (&lowest, _) = self
            .bands
            .range(..priority)
            .find(|(_, band)| band.requests > 0)?;
        let (idx, flow) = self
            .flows
            .iter()
            .enumerate()
            .filter_map(|(i, f)| Some((i, f.as_ref()?)))
            .filter(|(_, f)| f.key.priority == lowest && !f.items.is_empty())
            .max_by_key(|(i, f)| (f.items.len(), std::cmp::Reverse(*i)))?;
        let (&key, _) = flow.items.last_key_value()?;
        Some(Ticket {
            flow: FlowIdx(u32::try_from(idx).expect("under 2^32 flows")),
            key,
        })
    }
}
