#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hivemesh::fuzzing::sparse_codec(data));
