#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| shardwise_hf::fuzzing::hf_config(data));
