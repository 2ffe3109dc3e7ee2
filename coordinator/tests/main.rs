//! `stageb-coordinator`'s integration specs, as one test binary: one module per area.

mod ops_properties;
