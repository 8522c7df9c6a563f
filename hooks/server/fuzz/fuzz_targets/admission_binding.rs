//! Any bytes as the object of a pods/binding review (the binding backstop): an answer (an AdmissionReview or a JSON error), never a panic or a 500.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity_server::fuzzing::admission_binding(data);
});
