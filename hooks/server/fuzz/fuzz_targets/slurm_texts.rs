//! Any bytes as a TRES list, a constraint, a comment, and a process's cgroup, status and command line: never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    probity_server::fuzzing::slurm_texts(data);
});
