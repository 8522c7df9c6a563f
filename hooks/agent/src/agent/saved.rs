//! The agent's side of [`crate::findings::saved`]: taking up the findings a previous
//! process left in the state directory, and saving them again after each change.

use super::Agent;
use crate::config::Config;
use crate::findings::{Findings, saved};
use crate::sources::error_chain;

/// The findings saved in `config`'s state directory for its node (none without a
/// directory or a file), and, when a file was there but could not be used, why: said on
/// standard error at once, and in the first cycle's report.
pub(super) fn take_up(config: &Config) -> (Findings, Option<String>) {
    let Some(dir) = &config.state_dir else {
        return (Findings::new(), None);
    };
    match saved::load(dir, &config.node) {
        Ok(found) => (Findings::restore(found.unwrap_or_default()), None),
        Err(e) => {
            let problem = format!(
                "the saved findings were not taken up ({}): starting with no active finding, so those that still hold are raised again and those that cleared meanwhile are not recorded as cleared",
                error_chain(&e)
            );
            eprintln!("probity agent: {problem}");
            (Findings::new(), Some(problem))
        }
    }
}

impl Agent {
    /// Saves the active findings into the state directory (nothing without one); why
    /// not, when they could not be (the file keeps the findings saved before).
    pub(super) fn save_findings(&self, at: u64) -> Option<String> {
        let dir = self.config.state_dir.as_ref()?;
        saved::save(dir, &self.config.node, at, self.findings.active())
            .err()
            .map(|e| format!("saving the active findings: {}", error_chain(&e)))
    }
}
