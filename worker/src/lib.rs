//! stageb worker (skeleton)
