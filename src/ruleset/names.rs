//! Names of every kernel object nodeproxy creates.
