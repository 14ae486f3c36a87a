//! One-time warnings: where the engine runs a model otherwise than its user may believe
//! (a setting the path ignores, a layer no unit claims, a short micro-batch), it says so
//! once, on world rank 0's standard error, and keeps the message for
//! [`Engine::notices`](super::Engine::notices).

/// The warnings an engine gave.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    given: Vec<String>,
    /// Whether this rank prints them (world rank 0).
    lead: bool,
}

impl Notices {
    /// Notices of a rank that prints them if `lead`.
    pub fn new(lead: bool) -> Self {
        Self { given: Vec::new(), lead }
    }

    /// Gives `message` unless it was given before.
    pub fn warn(&mut self, message: String) {
        if self.given.contains(&message) {
            return;
        }
        if self.lead {
            eprintln!("zerotrain: warning: {message}");
        }
        self.given.push(message);
    }

    /// Every message given, in order.
    pub fn all(&self) -> &[String] {
        &self.given
    }
}
