//! Any bytes as ExtenderArgs sent to the scheduler extender's prioritize: an answer (an AdmissionReview or a JSON error), never a panic or a 500.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity_server::fuzzing::extender_prioritize(data);
});
