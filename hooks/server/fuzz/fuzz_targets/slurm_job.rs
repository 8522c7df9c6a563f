//! Any bytes as a `POST /v1/slurm/submit` body, read into workloads: an error, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity_server::fuzzing::slurm_job(data);
});
