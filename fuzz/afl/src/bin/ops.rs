//! AFL++ harness for kvq-fuzz's `ops` target.

fn main() {
    kvq_afl::fuzz("ops");
}
