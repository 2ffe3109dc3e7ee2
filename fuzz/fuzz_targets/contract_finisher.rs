//! libFuzzer entry for `stageb_fuzz::checks::contract_finisher`: the input and its invariants
//! are described there, where the stable corpus replay (`tests/fuzz_corpus.rs`) runs them too.
//! The constraint factory is built at initialization, outside any input's time limit.
#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        stageb_fuzz::checks::contract_finisher::factory();
    },
    |data: &[u8]| stageb_fuzz::checks::contract_finisher::check(data)
);
