//! Kubernetes resource quantities ("500m", "2", "1.5", "1k") as integers.

use serde_json::Value;

/// Splits a quantity into its number and its suffix's factor in thousandths.
fn millis(q: &Value) -> Option<i64> {
    let s = match q {
        Value::String(s) => s.trim().to_owned(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    let digits_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    // Factor of the suffix, in thousandths of a unit.
    let factor: i64 = match suffix {
        "" => 1000,
        "m" => 1,
        "k" => 1_000_000,
        "M" => 1_000_000_000,
        "Ki" => 1024 * 1000,
        "Mi" => 1024 * 1024 * 1000,
        _ => return None,
    };
    let number = number.strip_prefix('+').unwrap_or(number);
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() {
        return None;
    }
    if !whole.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: i64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut total = whole.checked_mul(factor)?;
    // The fraction, rounded up as Kubernetes does for milli-units.
    let mut scale = factor;
    let mut rest = false;
    for d in frac.bytes() {
        let d = i64::from(d - b'0');
        if scale >= 10 {
            scale /= 10;
            total = total.checked_add(d.checked_mul(scale)?)?;
        } else if d > 0 {
            rest = true;
        }
    }
    if rest {
        total = total.checked_add(1)?;
    }
    Some(total)
}

/// A CPU quantity in millicores.
pub(super) fn cpu_millis(q: &Value) -> Option<i64> {
    millis(q)
}

/// A whole-number quantity (GPUs).
pub(super) fn count(q: &Value) -> Option<i64> {
    let m = millis(q)?;
    (m % 1000 == 0).then_some(m / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cpu_quantities() {
        for (q, want) in [
            (json!("500m"), Some(500)),
            (json!("2"), Some(2000)),
            (json!("1.5"), Some(1500)),
            (json!("0.1"), Some(100)),
            (json!(".5"), Some(500)),
            (json!("0.0001"), Some(1)),
            (json!(4), Some(4000)),
            (json!("1k"), Some(1_000_000)),
            (json!(""), None),
            (json!("m"), None),
            (json!("1.2.3"), None),
            (json!("-1"), None),
            (json!("2x"), None),
            (json!(true), None),
            (json!("99999999999999999999"), None),
        ] {
            assert_eq!(cpu_millis(&q), want, "{q}");
        }
    }

    #[test]
    fn gpu_counts_are_whole() {
        assert_eq!(count(&json!("2")), Some(2));
        assert_eq!(count(&json!(1)), Some(1));
        assert_eq!(count(&json!("1.5")), None);
        assert_eq!(count(&json!("500m")), None);
    }
}
