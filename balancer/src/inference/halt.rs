//! Why a step of a request ends before the proxying ([`Halt`]): the
//! balancer refuses it, or its connection failed. One error type, so that
//! every step passes either on with `?`.

use pingora_core::Error;

use crate::reply::Refusal;

/// A request's step ended short of proxying it.
pub(crate) enum Halt {
    /// The balancer refuses it: this answer goes to the client.
    Refused(Refusal),
    /// Its connection failed (the client went away, a write failed):
    /// Pingora's error, and nobody to answer.
    Failed(Box<Error>),
}

/// What a step of a request comes to: its value, or the halt that ends
/// the request here.
pub(crate) type Flow<T> = std::result::Result<T, Halt>;

impl From<Refusal> for Halt {
    fn from(refusal: Refusal) -> Self {
        Halt::Refused(refusal)
    }
}

impl From<Box<Error>> for Halt {
    fn from(e: Box<Error>) -> Self {
        Halt::Failed(e)
    }
}
