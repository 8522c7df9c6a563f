//! Any bytes as a request: an error or a request, never a panic; and the memo of
//! parsed bodies answers every repeat exactly as the parser does.
#![no_main]
use std::sync::LazyLock;

static MEMO: LazyLock<probity::ParsedRequests> =
    LazyLock::new(|| probity::ParsedRequests::new(1 << 20, 4096));

fn outcome(r: Result<probity::Request, probity::RequestError>) -> String {
    match r {
        Ok(r) => format!(
            "{} {} {} {:?} {:?} {}",
            r.principal(),
            r.action(),
            r.resource(),
            r.context(),
            r.entities(),
            r.is_fact_reporter()
        ),
        Err(e) => e.to_string(),
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let parsed = outcome(probity::Request::from_json_slice(data));
    // The memo has no size bound of its own (its caller bounds the body).
    if data.len() > probity::Request::MAX_BYTES {
        return;
    }
    for _ in 0..3 {
        assert_eq!(outcome(MEMO.parse(data)), parsed);
    }
});
