//! AFL++ harness for kvq-fuzz's `block` target.

fn main() {
    kvq_afl::fuzz("block");
}
