//! Errors shown to people: an error and its causes on one line.

/// `error`, then each of its causes, joined by `: ` (for logs and reports, where the
/// chain would otherwise be lost; an error's own message never repeats its cause).
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn the_causes_follow_the_error() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(super::chain(&e), "outer: inner");
    }
}
