//! AFL++ harness for kvq-fuzz's `load` target.

fn main() {
    kvq_afl::fuzz("load");
}
