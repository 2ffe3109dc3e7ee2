//! stageb coordinator (skeleton)
