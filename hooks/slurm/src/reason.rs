//! The drain reason Probity writes, and how it recognises its own.
//!
//! LBNL's NHC is the anchor: it drains with a prefix of its own and never resumes a
//! node whose reason it did not write. Probity's reason is `Probity: <policy>:
//! <message>`, so an operator reading `sinfo -R` sees which rule drained the node.

/// What every drain reason Probity writes begins with.
pub const PREFIX: &str = "Probity: ";

/// Longest reason written (Slurm keeps any length; `sinfo -R` and logs stay readable).
pub const MAX_REASON: usize = 240;

/// `Probity: <policy>: <message>`, on one line and at most [`MAX_REASON`] bytes.
pub fn drain_reason(policy: &str, message: &str) -> String {
    let text = if message.is_empty() {
        format!("{PREFIX}{policy}")
    } else {
        format!("{PREFIX}{policy}: {message}")
    };
    one_line(&text)
}

/// A reason Probity already phrased (`Probity: ...`), or any text made one: kept on one
/// line and bounded.
pub fn one_line(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if !out.starts_with(PREFIX) {
        out.insert_str(0, PREFIX);
    }
    if out.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}

/// Whether a node's reason is Probity's own.
pub fn is_probitys(reason: &str) -> bool {
    reason.starts_with(PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_the_policy_on_one_bounded_line() {
        assert_eq!(
            drain_reason("thermal.gpu-over-temperature", "GPU 3 at 91 C\nsecond line"),
            "Probity: thermal.gpu-over-temperature: GPU 3 at 91 C second line"
        );
        let long = drain_reason("p", &"é".repeat(500));
        assert!(long.len() <= MAX_REASON && long.starts_with(PREFIX));
        assert_eq!(one_line("disk"), "Probity: disk");
        assert_eq!(one_line("Probity: x: y"), "Probity: x: y");
        assert!(is_probitys("Probity: x"));
        assert!(!is_probitys("probity: x") && !is_probitys("Prolog error"));
    }
}
