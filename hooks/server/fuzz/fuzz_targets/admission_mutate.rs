//! Any bytes as an AdmissionReview sent to the mutating webhook: an answer (an AdmissionReview or a JSON error), never a panic or a 500.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity_server::fuzzing::admission_mutate(data);
});
