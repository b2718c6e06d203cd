//! Error measured where the cache is used (work in progress).
